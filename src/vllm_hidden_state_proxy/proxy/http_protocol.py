"""uvicorn's httptools protocol with the two limits on request heads it lacks: their size and
the time they take to arrive.

httptools buffers a header that has not ended yet without bound, and uvicorn runs no timer
until a head is complete, so one endless header grows memory and a few thousand half-sent
heads hold as many file descriptors for as long as their clients like. Here:

- **size**: a head that grows past ``max_head_bytes`` before it ends, or ends larger than that,
  gets 431 and its connection is closed;
- **time**: a head must be complete within ``head_timeout`` seconds of the connection's
  opening (the first request) or of its own first byte (a later one on a kept-alive
  connection; the wait before that byte is uvicorn's keep-alive timeout); otherwise 408 and
  the connection is closed.

Both answers are plain text, like uvicorn's own 400 for a malformed head: no request has
reached the proxy's app yet. The protocol is built per connection by uvicorn from
:func:`protocol_factory` (a ``functools.partial``, so that it pickles into the worker processes
of ``--workers N``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from vllm_hidden_state_proxy.proxy.vectors.memory import CUT_EXTENSION

#: Per header, the bytes a head carries besides its name and value (": " and CRLF).
_HEADER_FRAMING = 4


_CONTINUE = b"HTTP/1.1 100 "


class _HeadWithBody:
    """The transport a request's response is written through: its head (uvicorn writes it
    alone, at ``http.response.start``) is held until the first body bytes, and both go out in
    one write (one system call instead of two: a measurable share of the hop's CPU, issue #46).
    A head whose body takes longer is written when the event loop next turns."""

    __slots__ = ("_head_due", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._head_due = True

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._head_due and not data.startswith(_CONTINUE):
            self._head_due = False
            self._held = data
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _plain_response(status: int, text: bytes) -> bytes:
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(text),
            b"connection: close\r\n\r\n",
            text,
        ]
    )


_HEAD_TOO_LARGE = b"Request head too large."
_HEAD_TIMEOUT = b"Request head not received in time."


async def _head_too_large(scope: Scope, receive: Receive, send: Send) -> None:
    """The app a complete but oversized head gets instead of the proxy's (its body unread)."""
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
    headers.append((b"content-length", b"%d" % len(_HEAD_TOO_LARGE)))
    await send({"type": "http.response.start", "status": 431, "headers": headers})
    await send({"type": "http.response.body", "body": _HEAD_TOO_LARGE})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a bound on the size of request heads and a timer on
    their arrival (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        max_head_bytes: int,
        head_timeout: float,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        #: Bytes received since the current head began; ``None`` while no head is pending.
        self.head_bytes: int | None = None
        self.head_timer: asyncio.TimerHandle | None = None

    # -- the head's clock and size ------------------------------------------------------------

    def _head_begins(self) -> None:
        # The first head is counted and timed from the connection's opening; a later one from
        # its first byte, its count from the next read (httptools does not say where in a read
        # a head begins): at most one read (uvloop's: 256 KiB) over the limit.
        if self.head_bytes is None:
            self.head_bytes = 0
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout, self._head_expired)

    def _head_ends(self) -> None:
        self.head_bytes = None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _responding(self) -> bool:
        """A response is still due on this connection (its pipelined heads wait for it)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _refuse(self, status: int, text: bytes) -> None:
        self._head_ends()
        if self.transport.is_closing():
            return
        if not self._responding():  # else a status line would land inside another response
            self.transport.write(_plain_response(status, text))
        self.transport.close()

    def _head_expired(self) -> None:
        self.head_timer = None
        if self._responding():
            # The server, not the client, holds this head back: uvicorn stops reading while a
            # pipelined request waits. Its clock starts again.
            self.head_timer = self.loop.call_later(self.head_timeout, self._head_expired)
            return
        self.logger.info("Closing a connection whose request head did not arrive in time.")
        self._refuse(408, _HEAD_TIMEOUT)

    # -- uvicorn's callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_begins()  # a connection that never sends a byte times out too

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_ends()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.head_bytes is not None:
            self.head_bytes += len(data)
        super().data_received(data)
        # Still inside a head after this chunk: it has not ended within the limit.
        if self.head_bytes is not None and self.head_bytes > self.max_head_bytes:
            self.logger.info("Closing a connection whose request head exceeds the limit.")
            self._refuse(431, _HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begins()

    def on_headers_complete(self) -> None:
        self._head_ends()
        size = len(self.url) + sum(len(n) + len(v) + _HEADER_FRAMING for n, v in self.headers)
        if size <= self.max_head_bytes:
            # The app may cut this connection: a client that does not take its response in time
            # (replies.py). abort(), not close(): close() would keep what is buffered for a
            # client that never reads.
            extensions: dict[str, Any] = {CUT_EXTENSION: self.transport.abort}
            self.scope["extensions"] = extensions  # type: ignore[typeddict-item]
            super().on_headers_complete()
            self.cycle.transport = _HeadWithBody(self.transport)  # type: ignore[assignment]
            return
        # A head that arrived whole in one read: it goes through uvicorn's own path (pipelined
        # requests stay in order) with an app that answers 431 in place of the proxy's.
        app = self.app
        self.app = _head_too_large
        try:
            super().on_headers_complete()
        finally:
            self.app = app


def protocol_factory(max_head_bytes: int, head_timeout: float) -> type[asyncio.Protocol]:
    """What uvicorn's ``http=`` gets: it calls it per connection as it would the class."""
    factory = functools.partial(
        LimitedHttpToolsProtocol, max_head_bytes=max_head_bytes, head_timeout=head_timeout
    )
    return factory  # type: ignore[return-value]  # a partial of the class, called like it
