"""The streaming arms and their timing of each token (bench/streaming.py), against fake
servers."""

from __future__ import annotations

import io
from collections.abc import Mapping

import anyio
import httpx
import orjson
import pytest

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench import streaming
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.streaming import (
    StreamTiming,
    timed_stream,
    tokens_in_event,
)


def test_both_arms_take_turns_and_every_gap_is_counted() -> None:
    fake = FakeServers()
    options = BenchOptions(smoke=True, stream_tokens=8)  # 2 streams per arm
    table = anyio.run(streaming.run, fake.stack("key"), options, Progress(io.StringIO()))
    assert [row["arm"] for row in table.rows] == ["stream_direct", "stream_proxy"]
    for row in table.rows:
        assert row["n"] == 2 and row["gaps"] == 2 * 7
        assert isinstance(row["last token p50 ms"], float) and row["last token p50 ms"] > 0
        assert isinstance(row["burst streams"], int)
    assert table.get("stream_proxy", "ITL mean / direct") is not None
    assert table.get("stream_direct", "ITL mean / direct") is None
    # A warm-up stream per arm, then the arms take turns, the first rotating.
    warm_up, rounds = ["vllm", "proxy"], ["vllm", "proxy", "proxy", "vllm"]
    assert [host for host, _, _ in fake.seen] == [*warm_up, *rounds]
    assert all(document["max_tokens"] == 8 and document["stream"] for _, _, document in fake.seen)


def test_tokens_are_counted_per_event_also_when_vllm_merges_them() -> None:
    def event(delta: dict[str, str], token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, object] = {"index": 0, "delta": delta}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return orjson.dumps({"choices": [choice]})

    assert tokens_in_event(event({"role": "assistant", "content": ""})) == 0
    assert tokens_in_event(event({"content": "ab"}, [5, 6, 7])) == 3
    assert tokens_in_event(event({"content": ""}, [9])) == 1  # a partial UTF-8 character
    assert tokens_in_event(event({"content": "x"})) == 1  # no token_ids: one per event
    assert tokens_in_event(orjson.dumps({"choices": [], "usage": {"completion_tokens": 64}})) == 0


def test_stream_timing_tells_a_burst_from_a_stream() -> None:
    assert StreamTiming(0.1, [1e-5] * 62 + [0.01], 0.2).burst
    assert not StreamTiming(0.1, [0.002] * 63, 0.3).burst


def sse(*events: Mapping[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_a_stream_is_timed_token_by_token_and_must_bring_every_token() -> None:
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    body = sse(role, *({"choices": [{"delta": {"content": "x"}, "token_ids": [1]}]},) * 4)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def main(expected: int) -> StreamTiming:
        async with httpx.AsyncClient(base_url="http://f", transport=transport) as client:
            return await timed_stream(client, b"{}", expected)

    timing = anyio.run(main, 4)
    assert len(timing.gaps) == 3 and 0 < timing.ttft <= timing.total
    with pytest.raises(BenchError, match="4 tokens, expected 5"):
        anyio.run(main, 5)
