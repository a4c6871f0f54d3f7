"""Relaying: vLLM's answer back to the client byte for byte, as it arrives; and passing a request
through (sent as it came, the answer relayed)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx

from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.types import Scope, Send
from vllm_hidden_state_proxy.proxy.upstream import close_quietly, open_upstream

log = logging.getLogger(__name__)


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


async def pass_through(state: ProxyState, scope: Scope, send: Send, body: bytes) -> None:
    """Pass one request through: sent as it came (with ``body``), the answer relayed back."""
    try:
        response = await open_upstream(state, scope, body)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        await relay_response(state, send, response)
    finally:
        await close_quietly(response)
