"""The throughput sweep (bench/throughput.py), against fake servers."""

from __future__ import annotations

import io

import anyio
import orjson

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench import throughput
from vllm_hidden_state_proxy.bench.client import chat_body
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress


def test_the_sweep_takes_turns_at_every_level_and_pairs_rounds() -> None:
    fake = FakeServers()
    options = BenchOptions(concurrency=(1, 4), smoke=True)  # one round, bursts of max(N, 2)
    table = anyio.run(throughput.run, fake.stack(), options, Progress(io.StringIO()))
    assert [row["concurrency"] for row in table.rows] == [1, 4]
    for row in table.rows:
        assert row["requests per arm"] == {1: 2, 4: 4}[int(str(row["concurrency"]))]
        for column in ("direct req/s", "flagged req/s", "passthrough / direct", "flagged / direct"):
            value = row[column]
            assert isinstance(value, float) and value > 0
    flagged = [d for _, _, d in fake.seen if "kv_transfer_params" in d]
    assert len(flagged) == (1 + 4) + (2 + 4)  # warm-up bursts, then the round
    assert orjson.loads(chat_body("m", 0))["max_tokens"] == 1
