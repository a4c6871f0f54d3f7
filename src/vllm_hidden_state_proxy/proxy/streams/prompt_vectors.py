"""Stream rewriting: the vectors ride on the first server-sent event that carries a choice.

vLLM streams ``data: <json>\\n\\n`` events (chat and completions chunks, an optional usage
chunk with ``"choices": []``, in-stream errors, ``data: [DONE]``). The proxy holds the stream
until its first chunk whose ``choices`` list is non-empty, joins the vectors into that chunk's
``kv_transfer_params`` and relays every other byte unchanged: it looks at events only until
that one is found, then the stream is a plain byte copy. Headers and that first chunk are sent
once the vectors are in hand (they were published at prefill, before vLLM produced the chunk),
so a missing vector is a proper error response before any byte of the stream.

A flagged stream that ends before any choice (vLLM failed before its first output, and streamed
only an error event) gets no 200: vLLM's error event becomes a JSON error response with its
code as the status, and a stream without one a 502.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Send

from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.errors import stream_without_choice
from vllm_hidden_state_proxy.proxy.replies import encoded_off_loop, send_counted_events
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import (
    DATA,
    EventCursor,
    complete_events,
    event_data,
    json_object,
)
from vllm_hidden_state_proxy.proxy.streams.relay import relay_body
from vllm_hidden_state_proxy.proxy.streams.rewriting import encoded_chunk, hold_until, send_head
from vllm_hidden_state_proxy.proxy.types import FieldsLater
from vllm_hidden_state_proxy.proxy.vectors.fields import with_kv_fields


@dataclass(frozen=True)
class ChoiceEvent:
    """The first choice-bearing event in a buffer: ``buffer[start:end]`` (no separator)."""

    start: int
    end: int
    chunk: dict[str, Any]


@dataclass(frozen=True)
class StreamEnded:
    """``data: [DONE]`` came before any choice: ``error`` is the data of vLLM's in-stream error
    event before it (the first), if it sent one."""

    error: bytes | None = None


class FirstChoiceScanner:
    """Scans complete events of a growing buffer, resuming where the last scan stopped (each
    byte is searched once, however the stream is cut)."""

    def __init__(self) -> None:
        self._cursor = EventCursor()
        #: The data of the first in-stream error event (``{"error": ...}``) seen so far.
        self.error: bytes | None = None

    def scan(self, buffer: bytes | bytearray) -> ChoiceEvent | StreamEnded | None:
        """The first choice event, ``StreamEnded``, or ``None`` (need more bytes)."""
        while True:
            bounds = self._cursor.take(buffer)
            if bounds is None:
                return None
            start, end = bounds
            data = event_data(bytes(buffer[start:end]))
            if data is None:
                continue
            if data.strip() == b"[DONE]":
                return StreamEnded(self.error)
            chunk = json_object(data)
            if chunk is None:
                continue
            choices = chunk.get("choices")
            if isinstance(choices, list) and choices:
                return ChoiceEvent(start, end, chunk)
            if self.error is None and "error" in chunk:
                self.error = data


def ended_before_a_choice(error: bytes | None) -> tuple[int, bytes]:
    """(status, JSON body) for a flagged stream that ended before its first choice: vLLM's
    in-stream error as it sent it, with its ``code`` as the status; the proxy's own 502 (with
    vLLM's error inside) when that code is not an HTTP error status, or when vLLM sent none."""
    details = None if error is None else (json_object(error) or {}).get("error")
    code = details.get("code") if isinstance(details, dict) else None
    if error is not None and isinstance(code, int) and 400 <= code <= 599:
        return code, error
    return 502, stream_without_choice(error).body()


def replace_event(buffer: bytes | bytearray, event: ChoiceEvent, chunk: dict[str, Any]) -> bytes:
    """``buffer`` with ``event`` replaced by a ``data:`` event carrying ``chunk`` (``ProxyError``
    502 if it cannot be written back)."""
    return bytes(buffer[: event.start]) + DATA + encoded_chunk(chunk) + buffer[event.end :]


async def relay_with_vectors(
    state: ProxyState,
    send: Send,
    response: httpx.Response,
    fields: FieldsLater,
) -> None:
    """Hold the stream until its first choice chunk, join ``fields()`` there, relay the rest.

    Raises ``ProxyError`` only before the response has started.
    """
    chunks = response.aiter_raw()
    scanner = FirstChoiceScanner()
    # vLLM's first choice is ~300 bytes, but it carries the whole prompt's echo, logprobs or
    # token ids when asked for.
    buffer, found = await hold_until(state, chunks, scanner.scan, "no choice")
    if not isinstance(found, ChoiceEvent):  # [DONE], or the end of the body, before a choice
        status, body = ended_before_a_choice(scanner.error)
        await send_response(send, status, body, b"application/json")
        return
    joined = await fields()
    head = await encoded_off_loop(
        lambda: replace_event(buffer, found, with_kv_fields(found.chunk, joined)), joined
    )
    await send_head(send, response)
    head, pending = complete_events(head)  # a partial event waits for its end (or an error)
    if not await send_counted_events(send, head):  # the vectors' event, within its deadline
        return
    await relay_body(state, send, chunks, error_event=True, pending=pending)
