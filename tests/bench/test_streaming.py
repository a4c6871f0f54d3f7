"""The streaming arms (bench/streaming.py), against fake servers."""

from __future__ import annotations

import io

import anyio

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.streaming import measure_streaming


def test_both_arms_take_turns_and_every_gap_is_counted() -> None:
    fake = FakeServers()
    table = anyio.run(measure_streaming, fake.stack("key"), 3, 8, Progress(io.StringIO()))
    assert [row["arm"] for row in table.rows] == ["stream_direct", "stream_proxy"]
    for row in table.rows:
        assert row["n"] == 3 and row["gaps"] == 3 * 7
        assert isinstance(row["last token p50 ms"], float) and row["last token p50 ms"] > 0
        assert isinstance(row["burst streams"], int)
    assert table.get("stream_proxy", "ITL mean / direct") is not None
    assert table.get("stream_direct", "ITL mean / direct") is None
    # A warm-up stream per arm, then the arms take turns, the first rotating.
    warm_up, rounds = ["vllm", "proxy"], ["vllm", "proxy", "proxy", "vllm", "vllm", "proxy"]
    assert [host for host, _, _ in fake.seen] == [*warm_up, *rounds]
    assert all(document["max_tokens"] == 8 and document["stream"] for _, _, document in fake.seen)
