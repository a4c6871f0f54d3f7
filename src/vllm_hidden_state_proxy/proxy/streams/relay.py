"""Relaying: vLLM's reply back to the client byte for byte, as it arrives; and passing a request
through (sent as it came, the reply relayed). A flagged stream that breaks off ends with an
error event (:mod:`.events` frames it)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable

import httpx
from starlette.types import Message, Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import complete_events, error_event
from vllm_hidden_state_proxy.proxy.upstream import broken_off, open_upstream
from vllm_hidden_state_proxy.transport import body_chunks, close_quietly

log = logging.getLogger(__name__)


async def relay_response(state: ProxyState, send: Send, response: httpx.Response) -> None:
    """Relay status, headers (minus hop-by-hop) and raw body chunks as they arrive.

    A reply of a known length (JSON) has its head sent with its first body bytes: vLLM (uvicorn)
    writes the two apart, and the front door then writes them to the client in one system call
    (``http_protocol.py``), not two (issue #46). Any other reply (an event stream) has its head
    sent at once."""
    start: Message = {
        "type": "http.response.start",
        "status": response.status_code,
        "headers": downstream_response_headers(response.headers.raw),
    }
    if "content-length" not in response.headers:  # a stream: its head at once
        await send(start)
        await relay_body(state, send, body_chunks(response))
        return
    await relay_body(state, send, body_chunks(response), start=start)


async def relay_body(
    state: ProxyState,
    send: Send,
    chunks: AsyncIterable[bytes],
    error_event: bool = False,
    pending: bytes = b"",
    start: Message | None = None,
) -> None:
    """Relay the (rest of the) body chunks as they arrive, then end the response.

    If the exchange with vLLM breaks off: with ``error_event`` (a flagged event stream, which
    the proxy rewrites anyway) the stream ends with an error event (``data: {"error": ...}``,
    which the OpenAI client raises); otherwise (passed through byte for byte) the connection is
    cut, so the client sees a truncated response rather than a complete-looking one.
    ``pending``: with ``error_event``, the start of a partial event of vLLM's, held until it is
    complete (:func:`complete_events`), so that an error event never lands inside it.
    ``start``: the response's head, not sent yet: it goes out just before the first body bytes
    (or the end, or the break)."""
    try:
        async for chunk in chunks:
            if error_event:
                chunk, pending = complete_events(pending + chunk)
                if not chunk:
                    continue
            if start is not None:
                await send(start)
                start = None
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.TransportError as exc:
        state.metrics.upstream_errors += 1
        if start is not None:  # the client gets the head, then the cut, as if relayed at once
            await send(start)
        if error_event:  # the partial event vLLM never finished is dropped
            await send_error_event(send, broken_off(state.settings, exc))
            return
        log.warning("vLLM response broke off mid-stream: %r", exc)
        return
    if start is not None:
        await send(start)
    await send({"type": "http.response.body", "body": pending, "more_body": False})


async def send_error_event(send: Send, error: ProxyError) -> None:
    """End a started event stream with ``error`` as its last event (``data: {"error": ...}``,
    which the OpenAI client raises; no ``[DONE]``)."""
    await send({"type": "http.response.body", "body": error_event(error), "more_body": False})


async def pass_through(state: ProxyState, scope: Scope, send: Send, body: bytes) -> None:
    """Pass one request through: sent as it came (with ``body``), the reply relayed back."""
    try:
        response = await open_upstream(state, scope, body)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        await relay_response(state, send, response)
    finally:
        await close_quietly(response)
