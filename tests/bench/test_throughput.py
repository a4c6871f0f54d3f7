"""The throughput sweep (bench/throughput.py), against fake servers."""

from __future__ import annotations

import io

import anyio
import orjson

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.client import chat_body
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.throughput import measure_throughput


def test_the_sweep_takes_turns_at_every_level_and_pairs_rounds() -> None:
    fake = FakeServers()
    table = anyio.run(
        measure_throughput,
        fake.stack(),
        (1, 4),
        2,
        lambda level: 2 * level,
        Progress(io.StringIO()),
    )
    assert [row["concurrency"] for row in table.rows] == [1, 4]
    for row in table.rows:
        assert row["requests per arm"] == 2 * 2 * row["concurrency"]  # type: ignore[operator]
        for column in ("direct req/s", "flagged req/s", "passthrough / direct", "flagged / direct"):
            value = row[column]
            assert isinstance(value, float) and value > 0
    flagged = [d for _, _, d in fake.seen if "kv_transfer_params" in d]
    assert len(flagged) == (1 + 4) + 2 * (2 + 8)  # warm-up bursts, then the rounds
    assert orjson.loads(chat_body("m", 0))["max_tokens"] == 1
