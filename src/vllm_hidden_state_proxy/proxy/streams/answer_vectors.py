"""A flagged stream with the answer's vectors (pooling ``"last_answer"``): each choice's vectors
ride on the chunk that carries its ``finish_reason``.

Up to the first choice, the stream is held as for the prompt's vectors (:mod:`.prompt_vectors`:
an error before it is a proper error response). From there the proxy reads every event, since
it must find each choice's last chunk and learn how many tokens the choice generated: the keyed
request asked for ``continuous_usage_stats``, whose ``usage.completion_tokens`` counts the
chunk's choice's tokens so far (:mod:`..vectors.answers`). It takes out what it asked for (each
chunk's ``usage``, the final usage chunk) and re-encodes the chunks it changes; every other
event goes on as vLLM wrote it.

Once the 200 has started, a choice whose vectors cannot be had ends the stream with an error
event (``data: {"error": {...}}``, the OpenAI client raises it) and no ``[DONE]``: never a
complete-looking stream without its vectors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.types import Send

from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.errors import ProxyError, chunk_without_count, event_too_large
from vllm_hidden_state_proxy.proxy.replies import encoded_off_loop, send_counted_events
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import (
    EventCursor,
    error_event,
    event_data,
    json_object,
    with_data,
)
from vllm_hidden_state_proxy.proxy.streams.prompt_vectors import (
    ChoiceEvent,
    FirstChoiceScanner,
    ended_before_a_choice,
)
from vllm_hidden_state_proxy.proxy.streams.rewriting import encoded_chunk, hold_until, send_head
from vllm_hidden_state_proxy.proxy.upstream import broken_off
from vllm_hidden_state_proxy.proxy.vectors.answers import AnswerAsks, ChoiceCount, counted
from vllm_hidden_state_proxy.proxy.vectors.fields import with_kv_fields
from vllm_hidden_state_proxy.request_fields import is_int

#: The vectors' fields for a finished choice.
ChoiceFields = Callable[[ChoiceCount], Awaitable[dict[str, Any]]]


class AnswerEvents:
    """Rewrites a stream's complete events, one at a time.

    When the proxy asked for ``include_usage``, vLLM puts ``system_fingerprint`` on the usage
    chunk instead of on each choice's last chunk. With one choice, its last chunk is held until
    the usage chunk comes (right after it) and given its fingerprint; with several, holding
    would reorder the stream, so their last chunks go on without it. The usage chunk is dropped.
    """

    def __init__(self, asks: AnswerAsks, fields: ChoiceFields) -> None:
        self.asks = asks
        self.fields = fields
        #: Finished choices' chunks held for the usage chunk's fingerprint: (event, chunk, sep).
        self._held: list[tuple[bytes, dict[str, Any], bytes]] = []
        #: What was rewritten since it was last sent carries vectors (sent within a deadline).
        self.carries_vectors = False

    async def rewrite(self, event: bytes, separator: bytes) -> bytes:
        """What to send on for ``event`` (and its separator): nothing, it, or it rewritten
        (with chunks held before it). Raises ``ProxyError``."""
        data = event_data(event)
        chunk = None if data is None else json_object(data)
        choices = None if chunk is None else chunk.get("choices")
        if chunk is None or not isinstance(choices, list):
            # [DONE], an error event, anything else: as vLLM wrote it, after what was held
            return self.release() + event + separator
        if not choices:
            if self.asks.usage and "usage" in chunk:
                return self.release(chunk.get("system_fingerprint"))
            return self.release() + event + separator
        usage = chunk.get("usage")
        changed = False
        if self.asks.continuous_usage and "usage" in chunk:
            chunk = {name: value for name, value in chunk.items() if name != "usage"}
            changed = True
        if any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices):
            fields = await self.fields(_finished(choices, usage))
            chunk = with_kv_fields(chunk, fields)
            if self.asks.usage and self.asks.choices == 1:
                self._held.append((event, chunk, separator))
                return b""
            written = chunk
            self.carries_vectors = True
            return (
                await encoded_off_loop(lambda: with_data(event, encoded_chunk(written)), fields)
                + separator
            )
        return with_data(event, encoded_chunk(chunk)) + separator if changed else event + separator

    def release(self, fingerprint: Any = None) -> bytes:
        """The held chunks, with ``fingerprint`` (vLLM's, from the usage chunk) if given."""
        out = bytearray()
        self.carries_vectors = self.carries_vectors or bool(self._held)
        for event, chunk, separator in self._held:
            if fingerprint is not None:
                chunk = {**chunk, "system_fingerprint": fingerprint}
            out += with_data(event, encoded_chunk(chunk)) + separator
        self._held.clear()
        return bytes(out)


def _finished(choices: list[Any], usage: Any) -> ChoiceCount:
    index = choices[0].get("index") if isinstance(choices[0], dict) else None
    if len(choices) != 1 or not is_int(index) or not isinstance(usage, dict):
        raise chunk_without_count()
    return counted(index, usage.get("completion_tokens"), usage.get("prompt_tokens"))


async def _rewrite_complete(
    buffer: bytearray, cursor: EventCursor, events: AnswerEvents
) -> tuple[bytes, ProxyError | None]:
    """The rewritten complete events at the start of ``buffer``, which loses them, and the
    error that stopped the rewriting, if one did (what was rewritten before it goes out)."""
    out = bytearray()
    error = None
    while (bounds := cursor.take(buffer)) is not None:
        start, end = bounds
        try:
            out += await events.rewrite(bytes(buffer[start:end]), bytes(buffer[end : cursor.next]))
        except ProxyError as failure:
            error = failure
            break
    consumed = cursor.next
    del buffer[:consumed]
    cursor.rebase(consumed)
    return bytes(out), error


async def _send_body(send: Send, body: bytes, more: bool = True) -> None:
    if body or not more:
        await send({"type": "http.response.body", "body": body, "more_body": more})


async def _send_events(send: Send, events: AnswerEvents, body: bytes, more: bool = True) -> bool:
    """Send ``body``: within the deadline of what carries vectors if it does (False: the client
    was too slow and is cut), as it comes otherwise."""
    if events.carries_vectors:
        events.carries_vectors = False
        return await send_counted_events(send, body, more)
    await _send_body(send, body, more)
    return True


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
    await send_head(send, response)
    cursor = EventCursor()
    events = AnswerEvents(asks, fields)
    limit = state.settings.max_answer_bytes
    try:
        out, error = await _rewrite_complete(buffer, cursor, events)
        if not await _send_events(send, events, out):
            return
        if error is None:
            async for chunk in chunks:
                buffer += chunk
                out, error = await _rewrite_complete(buffer, cursor, events)
                if not await _send_events(send, events, out):
                    return
                if error is None and len(buffer) > limit:
                    error = event_too_large(limit)
                if error is not None:
                    break
    except httpx.TransportError as exc:
        # Headers are out: the stream ends with an error event (the choices finished before
        # it keep their vectors).
        state.metrics.upstream_errors += 1
        error = broken_off(state.settings, exc)
    if error is not None:  # the choices finished before it keep their vectors
        end = events.release() + error_event(error)
        await _send_events(send, events, end, more=False)
        return
    await _send_events(send, events, events.release() + bytes(buffer), more=False)
