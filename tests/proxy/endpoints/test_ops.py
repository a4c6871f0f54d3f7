"""``GET /health`` and ``GET /metrics`` (proxy/endpoints/ops.py): both consult vLLM too; health also
reports an engine of a publishing vLLM that has no ring, metrics the rings' gauges."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    Handler,
    create_writer,
    error_of,
    proxy_client,
    publishing_handler,
    settings_for,
)
from vllm_hidden_state_proxy.ring import EngineFailure, FailureNote, RingWriter

pytestmark = pytest.mark.anyio

VLLM_METRICS = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model="m"} 0.0'
FLAGGED = {"messages": [], "kv_transfer_params": {"return_last_hidden_state": True}}


def ops_handler(health_status: int = 200, metrics_status: int = 200, delay: float = 0.0) -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(delay)
        if request.url.path == "/health":
            return httpx.Response(health_status)
        if request.url.path == "/metrics":
            return httpx.Response(metrics_status, content=VLLM_METRICS)
        return httpx.Response(200, json={"ok": True})

    return handle


# ---------------------------------------------------------------------------------------------
# /health
# ---------------------------------------------------------------------------------------------


async def test_health_is_200_when_vllm_is_healthy() -> None:
    vllm = FakeVLLM(ops_handler())
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.get("/health")
    assert (response.status_code, response.content) == (200, b"")
    assert [r.url.path for r in vllm.requests] == ["/health"]


@pytest.mark.parametrize(
    ("handler", "fragment"),
    [
        (ops_handler(health_status=500), "/health answered 500"),
        (ops_handler(delay=3600.0), "/health did not answer within 0.1 s"),
    ],
    ids=["vllm-500", "vllm-slow"],
)
async def test_health_is_503_when_vllm_is_not_healthy(handler: Handler, fragment: str) -> None:
    settings = settings_for("/unused", health_timeout=0.1)
    async with proxy_client(settings, FakeVLLM(handler), FakeRing()) as proxy:
        with anyio.fail_after(60):
            response = await proxy.client.get("/health")
    assert response.status_code == 503
    error = error_of(response)
    assert error["type"] == "service_unavailable"
    assert error["message"] == f"vLLM is not healthy: its {fragment}."


async def test_health_is_503_when_vllm_is_unreachable_the_details_behind_the_key() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    settings = settings_for("/unused", api_key="k")
    async with proxy_client(settings, FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.get("/health")
        detailed = await proxy.client.get("/health", headers={"authorization": "Bearer k"})
        wrong = await proxy.client.get("/health", headers={"authorization": "Bearer x"})
    assert response.status_code == detailed.status_code == wrong.status_code == 503
    # Without the key: in words, without vLLM's address or the exception.
    assert error_of(response)["message"] == "vLLM is not healthy: it cannot be reached."
    assert error_of(wrong)["message"] == error_of(response)["message"]
    message = error_of(detailed)["message"]
    assert "http://vllm.test:8000" in message and "ConnectError" in message


FAILURE = EngineFailure(instance=1, engine=1, pid=77, message="RingInUseError: held")
REFUSED = EngineFailure(1, 0, 77, "LayerConfigError: GPT2LMHeadModel does not support", True)
#: A vLLM that lacks what the hook reads: not the operator's settings, but fatal all the same.
INCOMPATIBLE = EngineFailure(
    1, 0, 77, "UnsupportedRunner: ExecuteModelState (V1) has no field hidden_states", fatal=True
)


@pytest.mark.parametrize(
    ("ring", "engine", "cause"),
    [
        # Some flagged requests would fail (whichever vLLM routes to that engine).
        (FakeRing(instance=1, failures=(FAILURE,)), 1, "RingInUseError: held"),
        # Layers the model cannot return: what the server was started for is not served at all.
        (FakeRing(present=False, failures=(REFUSED,)), 0, "GPT2LMHeadModel does not support"),
        # A vLLM the hook does not fit: nothing it was started for can be served either.
        (FakeRing(present=False, failures=(INCOMPATIBLE,)), 0, "has no field hidden_states"),
    ],
    ids=[
        "an-engine-of-a-publishing-vllm-has-no-ring",
        "the-hook-refused-the-servers-settings",
        "the-hook-does-not-fit-this-vllm",
    ],
)
async def test_health_is_503_naming_the_engine_the_cause_behind_the_key(
    ring: FakeRing, engine: int, cause: str
) -> None:
    settings = settings_for("/unused", api_key="k")
    async with proxy_client(settings, FakeVLLM(ops_handler()), ring) as proxy:
        response = await proxy.client.get("/health")
        detailed = await proxy.client.get("/health", headers={"authorization": "Bearer k"})
    assert response.status_code == detailed.status_code == 503
    words = error_of(response)["message"]
    assert words.startswith("vLLM is healthy, but ") and f"engine {engine} " in words
    assert cause not in words and "77" not in words  # no exception text, no pid
    message = error_of(detailed)["message"]
    assert message.startswith(f"vLLM at http://vllm.test:8000 is healthy, but engine {engine}")
    assert cause in message and "pid 77" in message


@pytest.mark.parametrize(
    "ring",
    [
        FakeRing(present=False, failures=(FAILURE,)),  # the hook is off everywhere
        FakeRing(instance=2, failures=(FAILURE,)),  # another vLLM, which publishes nothing
    ],
    ids=["no-instance-publishes", "failure-of-another-instance"],
)
async def test_health_is_200_when_no_engine_of_a_publishing_vllm_lacks_its_ring(
    ring: FakeRing,
) -> None:
    """Flagged requests get a clear 503 each; ordinary traffic must keep flowing."""
    async with proxy_client(settings_for("/unused"), FakeVLLM(ops_handler()), ring) as proxy:
        response = await proxy.client.get("/health")
    assert response.status_code == 200


async def test_a_refusal_beside_publishing_rings_is_another_servers() -> None:
    """A shared ring directory: the refusing engine belongs to a vLLM that publishes nothing,
    while this proxy's (some) vLLM publishes: that is the other server's failure."""
    ring = FakeRing(instance=2, failures=(REFUSED,))
    async with proxy_client(settings_for("/unused"), FakeVLLM(ops_handler()), ring) as proxy:
        assert (await proxy.client.get("/health")).status_code == 200


async def test_health_with_real_rings_and_notes(ring_dir: str, writer: RingWriter) -> None:
    other = FailureNote.write(ring_dir, instance=2, engine=0, message="other vLLM")
    try:
        async with proxy_client(settings_for(ring_dir), FakeVLLM(ops_handler())) as proxy:
            assert (await proxy.client.get("/health")).status_code == 200
            own = FailureNote.write(ring_dir, instance=1, engine=1, message="no space left")
            try:
                proxy.app.state.proxy.rings.refresh()
                response = await proxy.client.get("/health")
            finally:
                own.close()
    finally:
        other.close()
    assert response.status_code == 503
    message = error_of(response)["message"]
    assert "engine 1" in message and "no space left" not in message
    assert "other vLLM" not in message


# ---------------------------------------------------------------------------------------------
# /metrics
# ---------------------------------------------------------------------------------------------


async def test_metrics_are_vllms_then_the_proxys(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, content=VLLM_METRICS)
        return await publishing_handler(writer)(request)

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        assert (await proxy.client.post("/v1/chat/completions", json=FLAGGED)).status_code == 200
        assert (await proxy.client.get("/v1/models")).status_code == 200
        response = await proxy.client.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    assert text.startswith(VLLM_METRICS.decode() + "\n# HELP hidden_state_proxy_requests_total")
    lines = text.splitlines()
    for line in (
        'hidden_state_proxy_requests_total{kind="ordinary"} 1',
        'hidden_state_proxy_requests_total{kind="flagged"} 1',
        'hidden_state_proxy_requests_total{kind="embeddings"} 0',
        "hidden_state_proxy_flagged_requests_total 1",
        'hidden_state_proxy_vector_misses_total{reason="overwritten"} 0',
        'hidden_state_proxy_vector_misses_total{reason="not_published"} 0',
        'hidden_state_proxy_vector_misses_total{reason="engine_without_ring"} 0',
        "hidden_state_proxy_upstream_errors_total 0",
        "hidden_state_proxy_live_rings 1",
        f'hidden_state_proxy_ring_info{{instance="{writer.header.instance:016x}",engine="0",'
        'runner=""} 1',
        "hidden_state_proxy_engines_without_ring 0",
        "hidden_state_proxy_upstream_metrics_up 1",
        'hidden_state_proxy_vector_wait_seconds_bucket{le="+Inf"} 1',
        "hidden_state_proxy_vector_wait_seconds_count 1",
    ):
        assert line in lines, line


async def test_the_ring_gauges_follow_the_directory(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=VLLM_METRICS + b"\n")

    def gauges(text: str) -> tuple[str, str]:
        lines = text.splitlines()
        live = next(line for line in lines if line.startswith("hidden_state_proxy_live_rings "))
        without = next(
            line for line in lines if line.startswith("hidden_state_proxy_engines_without_ring ")
        )
        return live.split()[1], without.split()[1]

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        rings = proxy.app.state.proxy.rings
        assert gauges((await proxy.client.get("/metrics")).text) == ("1", "0")
        with create_writer(ring_dir, engine=1), create_writer(ring_dir, engine=2):
            note = FailureNote.write(ring_dir, instance=1, engine=3, message="m")
            try:
                rings.refresh()
                response = await proxy.client.get("/metrics")
                assert gauges(response.text) == ("3", "1")
                assert VLLM_METRICS.decode() + "\n# HELP" in response.text  # one newline
            finally:
                note.close()
        rings.refresh()
        assert gauges((await proxy.client.get("/metrics")).text) == ("1", "0")


@pytest.mark.parametrize("mode", ["status-500", "unreachable", "slow"])
async def test_metrics_without_vllm_still_serve_the_proxys_own(mode: str) -> None:
    release = anyio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        if mode == "unreachable":
            raise httpx.ConnectError("refused", request=request)
        if mode == "slow":  # answers only after the proxy's --metrics-upstream-timeout
            await release.wait()
            return httpx.Response(200, content=VLLM_METRICS)
        return httpx.Response(500, content=b"boom")

    ring = FakeRing(failures=(FAILURE,))
    settings = settings_for("/unused", metrics_upstream_timeout=0.2)
    async with proxy_client(settings, FakeVLLM(handle), ring) as proxy:
        started = time.monotonic()
        response = await proxy.client.get("/metrics")
        waited = time.monotonic() - started
        release.set()
    assert response.status_code == 200
    assert waited < 1.9  # the option, not the old fixed 2 s
    assert response.text.startswith("# HELP hidden_state_proxy_requests_total")
    assert "boom" not in response.text and "vllm:" not in response.text
    lines = response.text.splitlines()
    assert "hidden_state_proxy_engines_without_ring 1" in lines
    assert "hidden_state_proxy_upstream_metrics_up 0" in lines
