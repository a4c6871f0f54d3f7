"""The pools towards vLLM (transport/__init__.py) and the client of its ops routes
(transport/ops.py): the engine chosen, an injected transport used as it is, the ops client's
bound on a whole read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from vllm_hidden_state_proxy.transport import KEEPALIVE_EXPIRY, create_pool
from vllm_hidden_state_proxy.transport.aiohttp_client import AiohttpTransport
from vllm_hidden_state_proxy.transport.http1 import Http1Transport
from vllm_hidden_state_proxy.transport.ops import OpsClient

pytestmark = pytest.mark.anyio


async def test_the_engine_is_the_proxys_own_unless_another_is_asked_for() -> None:
    pooled = create_pool(8)
    assert isinstance(pooled, Http1Transport)  # the default engine
    await pooled.aclose()
    aiohttp = create_pool(8, engine="aiohttp")
    assert isinstance(aiohttp, AiohttpTransport)
    await aiohttp.aclose()
    own = create_pool(8, engine="httpx")
    assert isinstance(own, httpx.AsyncHTTPTransport)
    await own.aclose()
    assert KEEPALIVE_EXPIRY < 5.0  # vLLM (uvicorn) drops idle connections after 5 s


async def test_the_ops_client_uses_an_injected_transport_as_it_is() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    injected = httpx.MockTransport(handler)
    ops = OpsClient("http://vllm:8000/", injected)
    try:
        assert ops.transport is injected
        reply = await ops.get("/health", 1.5, authorization="Bearer k")
        assert (reply.status, reply.content) == (204, b"")
    finally:
        await ops.aclose()
    (request,) = seen
    assert str(request.url) == "http://vllm:8000/health"
    assert request.headers["authorization"] == "Bearer k"
    assert request.extensions["timeout"] == dict.fromkeys(("connect", "read", "write", "pool"), 1.5)
    # No client defaults (User-Agent, Accept-Encoding): what the proxy asks for, no more.
    assert "user-agent" not in request.headers and "accept-encoding" not in request.headers


async def test_an_ops_read_is_bounded_as_a_whole() -> None:
    async def endless(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"x"
            await anyio.sleep_forever()

        return httpx.Response(200, content=body())

    ops = OpsClient("http://vllm:8000", httpx.MockTransport(endless))
    with pytest.raises(TimeoutError):
        await ops.get("/metrics", 0.05)
