"""Find the first server-sent event of a stream that carries a choice, and rewrite only it.

vLLM streams ``data: <json>\\n\\n`` events (chat and completions chunks, an optional usage
chunk with ``"choices": []``, in-stream errors, ``data: [DONE]``). The proxy puts the vector on
the first chunk whose ``choices`` list is non-empty and relays every other byte unchanged: it
looks at events only until that one is found, then the stream is a plain byte copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_state_proxy.proxy.errors import ProxyError

#: Event separators (the SSE spec allows LF, CRLF and CR line ends; vLLM writes LF).
_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


@dataclass(frozen=True)
class ChoiceEvent:
    """The first choice-bearing event in a buffer: ``buffer[start:end]`` (no separator)."""

    start: int
    end: int
    chunk: dict[str, Any]


@dataclass(frozen=True)
class StreamEnded:
    """``data: [DONE]`` came before any choice (an error-only stream): nothing to rewrite."""


def _event_end(buffer: bytes | bytearray, start: int) -> tuple[int, int] | None:
    """(end of the event, start of the next one) for the event at ``start``, if complete."""
    best: tuple[int, int] | None = None
    for separator in _SEPARATORS:
        at = buffer.find(separator, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, at + len(separator))
    return best


def _event_data(event: bytes) -> bytes | None:
    """The event's data (``data:`` lines joined by LF), or ``None`` if it has none."""
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def _choice_chunk(data: bytes) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(chunk, dict) and isinstance(chunk.get("choices"), list) and chunk["choices"]:
        return chunk
    return None


class FirstChoiceScanner:
    """Scans complete events of a growing buffer, resuming where the last scan stopped."""

    def __init__(self) -> None:
        self._next = 0

    def scan(self, buffer: bytes | bytearray) -> ChoiceEvent | StreamEnded | None:
        """The first choice event, ``StreamEnded``, or ``None`` (need more bytes)."""
        while True:
            bounds = _event_end(buffer, self._next)
            if bounds is None:
                return None
            end, following = bounds
            start, self._next = self._next, following
            data = _event_data(bytes(buffer[start:end]))
            if data is None:
                continue
            if data.strip() == b"[DONE]":
                return StreamEnded()
            chunk = _choice_chunk(data)
            if chunk is not None:
                return ChoiceEvent(start, end, chunk)


def replace_event(buffer: bytes | bytearray, event: ChoiceEvent, chunk: dict[str, Any]) -> bytes:
    """``buffer`` with ``event`` replaced by a ``data:`` event carrying ``chunk``.

    Raises ``ProxyError`` (502) if ``chunk`` cannot be written back: orjson reads 1024 levels
    of nesting but writes 254 (vLLM's chunks are a few levels deep).
    """
    try:
        data = orjson.dumps(chunk)
    except orjson.JSONEncodeError as exc:
        raise ProxyError(502, f"vLLM streamed a chunk the proxy cannot re-encode: {exc}.") from None
    return bytes(buffer[: event.start]) + b"data: " + data + buffer[event.end :]
