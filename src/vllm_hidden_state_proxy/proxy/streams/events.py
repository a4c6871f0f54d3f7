"""Server-sent events (SSE): the one place that knows their framing. Where each complete event
of a growing buffer ends, its data, an event with its data replaced (the other lines, e.g.
``event:``, kept as they were), and the proxy's own last event (:func:`error_event`: an error that
ends a stream).

Used by the relay (:mod:`.relay`) and the three stream rewriters (:mod:`.prompt_vectors` for
chat and completions chunks, :mod:`.answer_vectors` for the answer's vectors,
:mod:`.responses` for the Responses API's events). Each byte is searched once however the
stream is cut: :class:`EventCursor` resumes where its last search stopped.
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_hidden_state_proxy.proxy.errors import ProxyError

#: Event separators (the SSE spec allows LF, CRLF and CR line ends; vLLM writes LF).
SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
#: The longest separator, less one: a separator can straddle two reads by this many bytes.
OVERLAP = 3
#: What starts a data line.
DATA = b"data: "
#: The separator the proxy writes after its own events (vLLM's: LF).
SEPARATOR = b"\n\n"
#: The most bytes of one partial event held back (a longer one goes on as it comes).
MAX_HELD = 1 << 20


def error_event(error: ProxyError, name: bytes | None = None) -> bytes:
    """The proxy's own last event of a started stream: an ``event:`` line if ``name`` (the
    Responses API's ``error``), ``data:`` the error's OpenAI body (which the OpenAI client
    raises), the separator."""
    named = b"event: " + name + b"\n" if name is not None else b""
    return named + DATA + error.body() + SEPARATOR


def complete_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete events at the start of ``data``, the partial one after them)."""
    cut = max(
        (at + len(separator) for separator in SEPARATORS if (at := data.rfind(separator)) != -1),
        default=0,
    )
    if cut == 0:
        return (data, b"") if len(data) > MAX_HELD else (b"", data)
    return data[:cut], data[cut:]


def event_end(buffer: bytes | bytearray, start: int, search_from: int) -> tuple[int, int] | None:
    """(end of the event, start of the next one) for the event at ``start``, if complete; no
    separator begins between ``start`` and ``search_from`` (already searched)."""
    best: tuple[int, int] | None = None
    for separator in SEPARATORS:
        at = buffer.find(separator, max(start, search_from))
        if at != -1 and (best is None or at < best[0]):
            best = (at, at + len(separator))
    return best


def event_data(event: bytes) -> bytes | None:
    """The event's data (``data:`` lines joined by LF), or ``None`` if it has none."""
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def json_object(data: bytes) -> dict[str, Any] | None:
    """An event's data (or a whole JSON reply of vLLM's) as a JSON object, or ``None`` if it is
    not one."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return document if isinstance(document, dict) else None


def with_data(event: bytes, data: bytes) -> bytes:
    """``event`` with its ``data:`` lines replaced by one carrying ``data``, where the first
    one was; its other lines (``event:``, ``id:``, comments) kept in place."""
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    kept: list[bytes] = []
    for line in lines:
        if not line.startswith(b"data:"):
            kept.append(line)
        elif data:
            kept.append(DATA + data)
            data = b""
    return b"\n".join(kept)


class EventCursor:
    """The complete events of a growing buffer, one at a time, from where the last one ended."""

    def __init__(self) -> None:
        #: Where the next event starts in the buffer.
        self.next = 0
        self._searched = 0

    def take(self, buffer: bytes | bytearray) -> tuple[int, int] | None:
        """(start, end) of the next complete event (``buffer[start:end]``, no separator), or
        ``None`` until more bytes arrive."""
        bounds = event_end(buffer, self.next, self._searched)
        if bounds is None:
            self._searched = max(self.next, len(buffer) - OVERLAP)
            return None
        end, following = bounds
        start, self.next = self.next, following
        return start, end

    def rebase(self, dropped: int) -> None:
        """The buffer lost its first ``dropped`` bytes (already sent on)."""
        self.next -= dropped
        self._searched = max(0, self._searched - dropped)
