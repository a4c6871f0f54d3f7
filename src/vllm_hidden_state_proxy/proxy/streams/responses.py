"""Responses API streams: the vectors ride on the ``response.completed`` event.

vLLM streams ``POST /v1/responses`` as named events (``event: response.created`` /
``data: {...}``) and ends after ``response.completed``, whose ``response`` is the final
response object. The vectors go there, in ``response.kv_transfer_params``, where the
non-streaming reply has them and where a client reading the final response finds them (the
openai SDK's ``stream.get_final_response()``, or the event itself). No earlier event carries
them: ``response.created`` comes before the prompt is computed.

The stream is held until its first event past ``response.created`` and
``response.in_progress`` (vLLM sends those two before prefill; the next ones come once the
prompt is computed, when the record is published), and the record is looked up then, so a
missing vector is a proper error response before any byte of the stream; an ``error`` or
``response.failed`` event before any output becomes a 502 with vLLM's event in it. After the
head, complete events are relayed as they arrive; only the one that mentions
``response.completed`` is parsed, and its ``data:`` line rewritten (its ``event:`` line kept).
A stream that fails after its head ends as vLLM ended it, without the vectors.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from starlette.types import Send

from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.errors import stream_without_output
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import (
    EventCursor,
    error_event,
    event_data,
    json_object,
    with_data,
)
from vllm_hidden_state_proxy.proxy.streams.rewriting import hold_until, send_head
from vllm_hidden_state_proxy.proxy.types import FieldsLater
from vllm_hidden_state_proxy.proxy.upstream import broken_off
from vllm_hidden_state_proxy.proxy.vectors.encoding import dump_json
from vllm_hidden_state_proxy.proxy.vectors.fields import with_kv_fields

log = logging.getLogger(__name__)

#: Events vLLM sends before the prompt is computed.
_PRELUDE = frozenset({"response.created", "response.in_progress"})
#: Events that end a stream with no output.
_FAILED = frozenset({"error", "response.failed"})
_COMPLETED = "response.completed"
_COMPLETED_MARK = b'"response.completed"'


class _Overflow(Exception):
    """An event longer than the proxy holds: the stream is cut (its head is already out)."""


def _prelude_outcome(
    buffer: bytes | bytearray, cursor: EventCursor
) -> tuple[str, bytes | None] | None:
    """("output", None) at the first event past the prelude, ("failed", its data) at an error
    before any output, ``None`` until one comes."""
    while (bounds := cursor.take(buffer)) is not None:
        data = event_data(bytes(buffer[bounds[0] : bounds[1]]))
        event = None if data is None else json_object(data)
        kind = None if event is None else event.get("type")
        if kind in _PRELUDE or data is None:
            continue
        if kind in _FAILED:
            return "failed", data
        return "output", None
    return None


class CompletedJoiner:
    """Relays complete events as they arrive, the ``response.completed`` one with ``fields``
    joined into its response's ``kv_transfer_params``."""

    def __init__(self, fields: dict[str, Any], limit: int) -> None:
        self.fields = fields
        self.limit = limit
        self.joined = False
        self._pending = bytearray()
        self._cursor = EventCursor()

    def feed(self, data: bytes | bytearray) -> bytes:
        """The bytes that can go on now (whole events; a partial one waits)."""
        pending = self._pending
        pending += data
        out = bytearray()
        copied = 0
        while (bounds := self._cursor.take(pending)) is not None:
            start, end = bounds
            if self.joined or _COMPLETED_MARK not in pending[start:end]:
                continue
            joined = self._join(bytes(pending[start:end]))
            if joined is not None:
                out += pending[copied:start]
                out += joined
                copied = end
        flushed = self._cursor.next
        out += pending[copied:flushed]
        del pending[:flushed]
        self._cursor.rebase(flushed)
        if len(pending) > self.limit:
            raise _Overflow(f"an event of the stream is longer than {self.limit} bytes")
        return bytes(out)

    def finish(self) -> bytes:
        """What is left when the stream ends (an event without its separator)."""
        rest, self._pending = bytes(self._pending), bytearray()
        if not self.joined and _COMPLETED_MARK in rest:
            joined = self._join(rest)
            if joined is not None:
                return joined
        return rest

    def _join(self, event: bytes) -> bytes | None:
        data = event_data(event)
        document = None if data is None else json_object(data)
        if document is None or document.get("type") != _COMPLETED:
            return None
        final = document.get("response")
        if not isinstance(final, dict):
            return None
        document["response"] = with_kv_fields(final, self.fields)
        self.joined = True
        return with_data(event, dump_json(document))


async def relay_responses_with_vectors(
    state: ProxyState,
    send: Send,
    response: httpx.Response,
    fields: FieldsLater,
) -> None:
    """Hold the stream until the prompt is computed, then relay it with ``fields()`` joined
    into its ``response.completed`` event. Raises ``ProxyError`` only before the head is out."""
    chunks = response.aiter_raw()
    limit = state.settings.max_answer_bytes
    cursor = EventCursor()
    buffer, outcome = await hold_until(
        state, chunks, lambda held: _prelude_outcome(held, cursor), "no output"
    )
    if outcome is None or outcome[0] != "output":
        error = None if outcome is None else outcome[1]
        await send_response(send, 502, stream_without_output(error).body(), b"application/json")
        return
    joiner = CompletedJoiner(await fields(), limit)
    head = joiner.feed(buffer)
    await send_head(send, response)
    await send({"type": "http.response.body", "body": head, "more_body": True})
    try:
        async for chunk in chunks:
            out = joiner.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
    except httpx.TransportError as exc:
        # The stream ends with an error event (a partial event of vLLM's is dropped), which
        # the OpenAI client raises.
        state.metrics.upstream_errors += 1
        failure = broken_off(state.settings, exc)
        last = error_event(failure, b"error")
        await send({"type": "http.response.body", "body": last, "more_body": False})
        return
    except _Overflow as exc:
        log.warning("a flagged Responses stream was cut: %s (--max-answer-size)", exc)
        return
    await send({"type": "http.response.body", "body": joiner.finish(), "more_body": False})
