"""One HTTP/1.1 connection of the proxy's own engine (:mod:`.http1`, whose docstring says what
it does): an asyncio protocol that feeds httptools, and the response to one request as it
arrives on it (:class:`Exchange`). The pool, the request's bytes and httpx's interface are in
:mod:`.http1`."""

from __future__ import annotations

import asyncio
import collections

import httptools
import httpx

#: The most bytes a response's status line and headers may take.
MAX_HEAD_BYTES = 256 * 1024
#: Body bytes buffered beyond what the reader took before the socket is paused.
HIGH_WATER = 256 * 1024


class Exchange:
    """One request's response as it arrives on a connection."""

    __slots__ = (
        "buffered",
        "chunks",
        "complete",
        "error",
        "framed",
        "head",
        "headers",
        "informational",
        "keep_alive",
        "reason",
        "received",
        "status",
        "waiter",
    )

    def __init__(self) -> None:
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.reason = b""
        #: A 1xx response is being read: its head is dropped, the final response follows.
        self.informational = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        #: The response lets the connection serve another request (read as it completes).
        self.keep_alive = False
        #: The body's end is marked by Content-Length or chunked encoding (else: by the close).
        self.framed = False
        self.error: httpx.TransportError | None = None
        self.waiter: asyncio.Future[None] | None = None
        #: Bytes of the response received so far (0: the server said nothing).
        self.received = 0


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.lost = False
        self.paused = False
        self.idle_since = 0.0
        self.reused = False
        #: Set once the socket is closed (asyncio's connection_lost ran); made on demand.
        self.closed: asyncio.Future[None] | None = None
        self._gone = False
        self._head_bytes = 0
        self._in_head = True

    # -- asyncio's callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection cannot be trusted
            self._drop()
            return
        exchange.received += len(data)
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # 101: the proxy asked for no other protocol
            self._fail(httpx.RemoteProtocolError("the server switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from the server: {exc}"))
            return
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(httpx.RemoteProtocolError("response head too large"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._gone = True
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(None)
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        if exchange.head is not None and exchange.head.done() and not exchange.framed:
            exchange.complete = True  # a body delimited by the connection's close
            self._wake(exchange)
            return
        error: httpx.TransportError
        if exc is not None:
            error = httpx.ReadError(str(exc) or type(exc).__name__)
        elif exchange.head is not None and exchange.head.done():
            error = httpx.RemoteProtocolError(
                "the server closed the connection before the end of the body"
            )
        else:
            error = httpx.RemoteProtocolError("the server closed the connection without a response")
        self._fail(error)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools' callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.complete:
            # A second response to one request: the connection is out of step; the first
            # response stands, the rest is ignored and the connection is never reused.
            self._drop()

    def on_status(self, status: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.complete:
            exchange.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.complete:
            exchange.headers.append((name, value))
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                exchange.framed = True

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        if exchange is None or exchange.head is None or exchange.head.done():
            return
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the final response follows
            exchange.informational = True
            exchange.headers = []
            exchange.reason = b""
            exchange.framed = False
            self._head_bytes = 0
            return
        self._in_head = False
        exchange.status = status
        if status in (204, 304):
            exchange.framed = True  # no body, whatever the headers say
        exchange.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.chunks.append(body)
        exchange.buffered += len(body)
        if exchange.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake(exchange)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        if exchange.informational:
            exchange.informational = False
            return
        if exchange.head is not None and exchange.head.done():
            exchange.complete = True
            exchange.keep_alive = self.parser.should_keep_alive()
            self._wake(exchange)

    # -- the exchange --------------------------------------------------------------------------

    @staticmethod
    def _wake(exchange: Exchange) -> None:
        waiter = exchange.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: httpx.TransportError) -> None:
        exchange = self.exchange
        if exchange is not None and exchange.error is None and not exchange.complete:
            exchange.error = error
            if exchange.head is not None and not exchange.head.done():
                exchange.head.set_exception(error)
            self._wake(exchange)
        self._drop()

    def _drop(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def start(self, head: bytes, body: bytes | None) -> Exchange:
        """Send a request (its head, and its body if in bytes); the exchange to await."""
        exchange = Exchange()
        exchange.head = asyncio.get_running_loop().create_future()
        self.exchange = exchange
        self._in_head = True
        self._head_bytes = 0
        transport = self.transport
        if transport is None:
            raise httpx.WriteError("not connected")
        # One write, one system call (uvloop's writelines is not one).
        transport.write(head + body if body else head)
        return exchange

    def taken(self, exchange: Exchange) -> None:
        """The reader took ``exchange``'s buffered chunks: resume reading if paused."""
        exchange.buffered = 0
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def reusable(self, exchange: Exchange) -> bool:
        return not self.lost and exchange.keep_alive

    def abort(self) -> None:
        self.exchange = None
        self._drop()

    def shut(self, error: httpx.TransportError) -> None:
        """Close the connection; an exchange still under way fails with ``error``."""
        self._fail(error)

    async def wait_closed(self) -> None:
        """Until the socket is closed (after :meth:`abort`)."""
        if not self._gone and self.transport is not None:
            if self.closed is None:
                self.closed = asyncio.get_running_loop().create_future()
            await self.closed


async def wait_for_reply(future: asyncio.Future[None], timeout: float | None) -> None:
    """Wait for ``future``; ``httpx.ReadTimeout`` after ``timeout`` seconds."""
    if timeout is None:
        await future
        return
    loop = asyncio.get_running_loop()
    timer = loop.call_later(timeout, _expire, future)
    try:
        await future
    finally:
        timer.cancel()


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(httpx.ReadTimeout("timed out waiting for the server"))
