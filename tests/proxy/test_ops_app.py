"""/health, /metrics, and the hand-written Prometheus exposition."""

from __future__ import annotations

import anyio
import httpx
import pytest

from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    Handler,
    error_of,
    proxy_client,
    publishing_handler,
    settings_for,
)

pytestmark = pytest.mark.anyio

VLLM_METRICS = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model="m"} 0.0'


def ops_handler(health_status: int = 200, metrics_status: int = 200, delay: float = 0.0) -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(delay)
        if request.url.path == "/health":
            return httpx.Response(health_status)
        if request.url.path == "/metrics":
            return httpx.Response(metrics_status, content=VLLM_METRICS)
        return httpx.Response(200, json={"ok": True})

    return handle


async def test_health_ok_when_vllm_healthy() -> None:
    vllm = FakeVLLM(ops_handler())
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.get("/health")
    assert response.status_code == 200
    assert [r.url.path for r in vllm.requests] == ["/health"]


@pytest.mark.parametrize(
    ("handler", "fragment"),
    [
        (ops_handler(health_status=500), "answered 500"),
        (ops_handler(delay=5.0), "did not answer within 0.1 s"),
    ],
    ids=["vllm-500", "vllm-slow"],
)
async def test_health_503_when_vllm_unhealthy(handler: Handler, fragment: str) -> None:
    settings = settings_for("/unused", health_timeout=0.1)
    async with proxy_client(settings, FakeVLLM(handler), FakeRing()) as proxy:
        with anyio.fail_after(2):
            response = await proxy.client.get("/health")
    assert response.status_code == 503
    error = error_of(response)
    assert error["type"] == "service_unavailable"
    assert fragment in error["message"]


async def test_health_503_when_vllm_unreachable() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.get("/health")
    assert response.status_code == 503
    assert "http://vllm.test:8000" in error_of(response)["message"]


async def test_metrics_concatenates_vllm_and_proxy_metrics(
    ring_dir: str, writer: RingWriter
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, content=VLLM_METRICS)
        return await publishing_handler(writer)(request)

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        flagged = {"messages": [], "kv_transfer_params": {"return_last_hidden_state": True}}
        assert (await proxy.client.post("/v1/chat/completions", json=flagged)).status_code == 200
        assert (await proxy.client.get("/v1/models")).status_code == 200
        response = await proxy.client.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    assert text.startswith(VLLM_METRICS.decode() + "\n# HELP hidden_state_proxy_requests_total")
    lines = text.splitlines()
    assert 'hidden_state_proxy_requests_total{kind="ordinary"} 1' in lines
    assert 'hidden_state_proxy_requests_total{kind="flagged"} 1' in lines
    assert "hidden_state_proxy_flagged_requests_total 1" in lines
    assert 'hidden_state_proxy_vector_misses_total{reason="overwritten"} 0' in lines
    assert 'hidden_state_proxy_vector_misses_total{reason="not_published"} 0' in lines
    assert "hidden_state_proxy_upstream_errors_total 0" in lines
    assert 'hidden_state_proxy_vector_wait_seconds_bucket{le="+Inf"} 1' in lines
    assert "hidden_state_proxy_vector_wait_seconds_count 1" in lines


@pytest.mark.parametrize("mode", ["status-500", "unreachable"])
async def test_metrics_without_vllm_still_serves_own(mode: str) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        if mode == "unreachable":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(500, content=b"boom")

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.get("/metrics")
    assert response.status_code == 200
    assert response.text.startswith("# HELP hidden_state_proxy_requests_total")
    assert "boom" not in response.text


def test_histogram_buckets_are_cumulative() -> None:
    metrics = ProxyMetrics()
    for value in (0.00005, 0.0001, 0.003, 0.003, 7.0, 60.0):
        metrics.vector_wait.observe(value)
    lines = metrics.render().decode().splitlines()
    bucket = {
        line.split('le="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("hidden_state_proxy_vector_wait_seconds_bucket")
    }
    assert bucket["0.0001"] == 2  # le is inclusive
    assert bucket["0.0025"] == 2
    assert bucket["0.005"] == 4
    assert bucket["5.0"] == 4
    assert bucket["10.0"] == 5
    assert bucket["+Inf"] == 6
    counts = list(bucket.values())
    assert counts == sorted(counts)
    assert "hidden_state_proxy_vector_wait_seconds_count 6" in lines
    total = next(
        line for line in lines if line.startswith("hidden_state_proxy_vector_wait_seconds_sum")
    )
    assert float(total.split()[1]) == pytest.approx(67.00615)
    # every sample line is "name{labels} value" or "name value"
    for line in lines:
        if not line.startswith("#"):
            sample, number = line.rsplit(" ", 1)
            assert float(number) >= 0
            assert sample.startswith("hidden_state_proxy_")
