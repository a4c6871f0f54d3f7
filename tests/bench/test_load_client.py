"""The load client against fake servers (httpx.MockTransport): counts, errors, token events."""

from __future__ import annotations

import itertools

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.bench.client import BenchError, timed_post
from vllm_hidden_state_proxy.bench.latency import Route
from vllm_hidden_state_proxy.bench.throughput import _burst


def client_for(handler: httpx.MockTransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://fake", transport=handler)


def test_a_burst_sends_exactly_count_requests_with_at_most_concurrency_in_flight() -> None:
    in_flight = 0
    peak = 0
    seen: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await anyio.sleep(0.001)
        in_flight -= 1
        seen.append(orjson.loads(request.content)["messages"][0]["content"])
        body = {"kv_transfer_params": {"last_hidden_state": [0.5]}}
        return httpx.Response(200, content=orjson.dumps(body))

    async def main() -> tuple[float, list[float]]:
        async with client_for(httpx.MockTransport(handler)) as client:
            route = Route("throughput_flagged", "f", "http://fake", "float")
            return await _burst(client, route, "m", 23, 4, itertools.count())

    seconds, latencies = anyio.run(main)
    assert len(latencies) == len(seen) == 23 and len(set(seen)) == 23  # each its own prompt
    assert peak <= 4 and seconds > 0 and all(latency > 0 for latency in latencies)


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
        (httpx.Response(200, text="{}"), "a flagged response without its vector"),
    ],
)
def test_a_failing_request_stops_the_burst_with_a_clear_error(
    response: httpx.Response, message: str
) -> None:
    async def main() -> None:
        async with client_for(httpx.MockTransport(lambda request: response)) as client:
            route = Route("throughput_flagged", "f", "http://fake", "float")
            await _burst(client, route, "m", 50, 8, itertools.count())

    with pytest.raises(BenchError, match=message) as caught:
        anyio.run(main)
    assert "throughput_flagged at concurrency 8" in str(caught.value)


def test_a_dropped_connection_is_a_bench_error_naming_the_url() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection closed", request=request)

    async def main() -> None:
        async with client_for(httpx.MockTransport(handler)) as client:
            await timed_post(client, "/v1/chat/completions", b"{}")

    with pytest.raises(BenchError, match=r"POST http://fake/v1/chat/completions: ReadError"):
        anyio.run(main)
