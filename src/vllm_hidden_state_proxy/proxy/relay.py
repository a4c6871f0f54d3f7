"""Relaying: send a request to vLLM and stream its answer back byte for byte."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import anyio
import httpx

from vllm_hidden_state_proxy.proxy.aiohttp_transport import ClosesAtOnce
from vllm_hidden_state_proxy.proxy.asgi import Scope, Send, send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.upstream import build_request, transport_error

log = logging.getLogger(__name__)


async def open_upstream(state: ProxyState, request: httpx.Request) -> httpx.Response:
    """Send ``request``; return once vLLM's status and headers are in (body not read yet).

    Raises ``ProxyError`` (502/504) if vLLM cannot be reached. The caller must close the
    response (``close_quietly``).
    """
    try:
        return await state.transport.handle_async_request(request)
    except httpx.TransportError as exc:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, exc) from exc


async def close_quietly(response: httpx.Response) -> None:
    """Close the upstream response even while being cancelled (a client disconnect).

    aiohttp's responses close without suspending, so nothing can cancel that; any other
    transport's close is shielded (a cancel scope per request is measurable CPU).
    """
    if isinstance(response.stream, ClosesAtOnce):
        await response.aclose()
        return
    with anyio.CancelScope(shield=True):
        await response.aclose()


async def relay_response(state: ProxyState, send: Send, response: httpx.Response) -> None:
    """Relay status, headers (minus hop-by-hop) and raw body chunks as they arrive."""
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": downstream_response_headers(response.headers.raw),
        }
    )
    await relay_body(state, send, response.aiter_raw())


async def relay_body(state: ProxyState, send: Send, chunks: AsyncIterator[bytes]) -> None:
    """Relay the (rest of the) body chunks as they arrive, then end the response."""
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.TransportError as exc:
        # Headers are out; all that is left is to cut the connection so the client sees a
        # truncated response rather than a complete-looking one.
        state.metrics.upstream_errors += 1
        log.warning("vLLM response broke off mid-stream: %r", exc)
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def forward(state: ProxyState, scope: Scope, send: Send, body: bytes) -> None:
    """Forward one request unchanged (apart from ``body``) and stream the answer back."""
    try:
        response = await open_upstream(state, build_request(state.settings, scope, body))
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        await relay_response(state, send, response)
    finally:
        await close_quietly(response)
