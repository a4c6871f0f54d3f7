"""A flagged stream with the answer's vectors (pooling ``"last_answer"``): each choice's vectors
ride on the chunk that carries its ``finish_reason``.

Up to the first choice, the stream is held as for the prompt's vectors (:mod:`.stream_rewrite`:
an error before it is a proper error response). From there the proxy reads every event, since
it must find each choice's last chunk and learn how many tokens the choice generated: the keyed
request asked for ``continuous_usage_stats``, whose ``usage.completion_tokens`` counts the
chunk's choice's tokens so far (:mod:`.answer_choices`). It takes out what it asked for (each
chunk's ``usage``, the final usage chunk) and re-encodes the chunks it changes; every other
event goes on as vLLM wrote it.

Once the 200 has started, a choice whose vectors cannot be had ends the stream with an error
event (``data: {"error": {...}}``, the OpenAI client raises it) and no ``[DONE]``: never a
complete-looking stream without its vectors.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from vllm_hidden_state_proxy.proxy.answer_choices import AnswerAsks
from vllm_hidden_state_proxy.proxy.answer_join import dump_json, with_kv_fields
from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.sse_events import EventCursor, event_data, json_object, with_data
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.stream_rewrite import (
    STREAM_DROP,
    ChoiceEvent,
    FirstChoiceScanner,
    ended_before_a_choice,
    hold_until,
)
from vllm_hidden_state_proxy.proxy.types import Send, is_int

log = logging.getLogger("vllm_hidden_state_proxy")

#: The vectors' fields for (choice index, its number of output tokens).
ChoiceFields = Callable[[int, int], Awaitable[dict[str, Any]]]


class AnswerEvents:
    """Rewrites one complete event at a time."""

    def __init__(self, asks: AnswerAsks, fields: ChoiceFields) -> None:
        self.asks = asks
        self.fields = fields

    async def rewrite(self, event: bytes) -> bytes | None:
        """The event to send on (``None``: drop it). Raises ``ProxyError``."""
        data = event_data(event)
        chunk = None if data is None else json_object(data)
        choices = None if chunk is None else chunk.get("choices")
        if chunk is None or not isinstance(choices, list):
            return event  # [DONE], an error event, anything else: as vLLM wrote it
        if not choices:
            return None if self.asks.usage and "usage" in chunk else event
        usage = chunk.get("usage")
        changed = False
        if self.asks.continuous_usage and "usage" in chunk:
            chunk = {name: value for name, value in chunk.items() if name != "usage"}
            changed = True
        if any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices):
            index = choices[0].get("index") if isinstance(choices[0], dict) else None
            count = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if len(choices) != 1 or not is_int(index) or not is_int(count):
                raise ProxyError(
                    502,
                    "vLLM streamed a choice's last chunk without its own token count (one choice "
                    "per chunk, with continuous usage stats), which the proxy needs to find the "
                    "answer's hidden state.",
                )
            chunk = with_kv_fields(chunk, await self.fields(index, count))
            changed = True
        return with_data(event, dump_json(chunk)) if changed else event


async def _rewrite_complete(buffer: bytearray, cursor: EventCursor, events: AnswerEvents) -> bytes:
    """The rewritten complete events at the start of ``buffer``, which loses them."""
    out = bytearray()
    while (bounds := cursor.take(buffer)) is not None:
        start, end = bounds
        rewritten = await events.rewrite(bytes(buffer[start:end]))
        if rewritten is not None:
            out += rewritten + buffer[end : cursor.next]  # its separator, as vLLM wrote it
    consumed = cursor.next
    del buffer[:consumed]
    cursor.rebase(consumed)
    return bytes(out)


async def _send_body(send: Send, body: bytes, more: bool = True) -> None:
    if body or not more:
        await send({"type": "http.response.body", "body": body, "more_body": more})


async def relay_with_answer_vectors(
    state: ProxyState,
    send: Send,
    response: httpx.Response,
    asks: AnswerAsks,
    fields: ChoiceFields,
) -> None:
    """Relay a flagged stream, each choice's vectors joined into its last chunk.

    Raises ``ProxyError`` only before the response has started.
    """
    chunks: AsyncIterator[bytes] = response.aiter_raw()
    scanner = FirstChoiceScanner()
    buffer, found = await hold_until(state, chunks, scanner.scan, "no choice")
    if not isinstance(found, ChoiceEvent):
        status, body = ended_before_a_choice(scanner.error)
        await send_response(send, status, body, b"application/json")
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": downstream_response_headers(response.headers.raw, drop=STREAM_DROP),
        }
    )
    cursor = EventCursor()
    events = AnswerEvents(asks, fields)
    limit = state.settings.max_answer_bytes
    try:
        await _send_body(send, await _rewrite_complete(buffer, cursor, events))
        async for chunk in chunks:
            buffer += chunk
            await _send_body(send, await _rewrite_complete(buffer, cursor, events))
            if len(buffer) > limit:
                raise ProxyError(
                    502,
                    f"vLLM streamed an event larger than {limit} bytes (the proxy's "
                    "--max-answer-size).",
                )
    except ProxyError as error:
        await _send_body(send, b"data: " + error.body() + b"\n\n", more=False)
        return
    except httpx.TransportError as exc:
        # Headers are out: cut the connection, so the client sees a truncated stream.
        state.metrics.upstream_errors += 1
        log.warning("vLLM response broke off mid-stream: %r", exc)
        return
    await _send_body(send, bytes(buffer), more=False)
