"""Bursts and the throughput sweep (bench/throughput.py), against fake servers."""

from __future__ import annotations

import io
import itertools

import anyio
import httpx
import orjson
import pytest

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.client import BenchError, chat_body
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.throughput import burst, measure_throughput


def test_a_burst_sends_exactly_count_requests_with_at_most_concurrency_in_flight() -> None:
    fake = FakeServers()
    stack = fake.stack()
    bodies = (chat_body("m", index, flag="float") for index in itertools.count())

    async def main() -> tuple[float, list[float]]:
        async with stack.client(stack.via_proxy("flagged", ""), 4) as client:
            return await burst(client, "flagged", bodies, 23, 4, vector=True)

    seconds, latencies = anyio.run(main)
    assert len(latencies) == len(fake.seen) == 23 and seconds > 0
    assert len({str(document["messages"]) for _, _, document in fake.seen}) == 23
    assert fake.peak <= 4


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
        (httpx.Response(200, text="{}"), "a flagged answer without its vector"),
    ],
)
def test_a_failing_request_stops_the_burst_with_a_clear_error(
    response: httpx.Response, message: str
) -> None:
    bodies = itertools.repeat(b"{}")

    async def main() -> None:
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(base_url="http://f", transport=transport) as client:
            await burst(client, "flagged", bodies, 50, 8, vector=True)

    with pytest.raises(BenchError, match=message) as caught:
        anyio.run(main)
    assert "flagged at concurrency 8" in str(caught.value)


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
