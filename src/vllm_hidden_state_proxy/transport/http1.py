"""An httpx transport of its own: HTTP/1.1 keep-alive connections on asyncio protocols, parsed
by ``httptools`` (llhttp, the parser uvicorn's front door uses too).

Why not aiohttp's client under httpx's interface (issue #46, ``docs/benchmark.md``): it cost
about 140 µs of CPU per request at the proxy's hop (a request object, a writer task per
request, a payload object, a connector and its locks), this one about 30 µs: the difference
that brings the proxy's hop under 3x a bare app's CPU per request. It does only what a proxy in
front of vLLM needs:

- a request goes out with exactly the headers given (``httpx.Request`` adds ``Host`` and
  ``Content-Length``; nothing else is added), its body as bytes (``Content-Length``) or, when
  it is a stream, chunked; no redirects, cookies or decompression; a CR or LF in a header or the
  target is refused (``LocalProtocolError``) before anything goes out;
- 1xx responses (``100 Continue``, ``103 Early Hints``) are skipped for the final one; a 101
  (a switch of protocols nobody asked for) is an error; HEAD, 204 and 304 have no body;
- the response returns once its status line and headers are in, with the body bytes that came
  with them; the rest streams as it arrives (at most :data:`_HIGH_WATER` bytes buffered: then
  the socket is paused), ``Content-Length``, chunked or until the connection closes;
- a response stream closed before its end (a client disconnect), or a request cancelled at any
  point before that, aborts the connection, so vLLM sees the disconnect and aborts the request;
  a complete one (its body read or not) returns it to the pool unless the response said
  ``Connection: close`` (or HTTP/1.0); bytes beyond the response, or on an idle connection,
  mean the connection is out of step: it is closed, never reused;
- a reused connection that the server closed before answering a single byte (its keep-alive
  timeout racing the request) is retried once on a fresh connection; nothing else is retried;
- httpx's per-request ``timeout`` extension applies (``connect``, and ``read``: the longest wait
  for the head or for the next body bytes); ``pool`` waits forever (the proxy's settings ask for
  that), ``write`` is not applied (a body in bytes is handed to the socket's buffer at once; a
  server that never reads it never answers: the ``read`` timeout ends the wait); at most
  ``limits.max_connections`` connections (``None``: no bound), idle ones kept for
  ``limits.keepalive_expiry`` seconds (``None``: until the server closes them);
- a head larger than :data:`MAX_HEAD_BYTES`, a malformed message, a body cut short or a reset
  connection arrive as httpx's errors (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``ReadError``, ``RemoteProtocolError``), which the proxy maps to 502/504;
- ``uds`` connects over a Unix domain socket (``vllm serve --uds``); ``https`` URLs get TLS with
  the default context.

HTTP/1.1 only: vLLM's OpenAI server (uvicorn) speaks nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator

import httptools
import httpx

from vllm_hidden_state_proxy.transport.closing import ClosesAtOnce

#: The most bytes a response's status line and headers may take.
MAX_HEAD_BYTES = 256 * 1024
#: Body bytes buffered beyond what the reader took before the socket is paused.
_HIGH_WATER = 256 * 1024


class _Exchange:
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


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
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
        if exchange.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
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
    def _wake(exchange: _Exchange) -> None:
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

    def start(self, head: bytes, body: bytes | None) -> _Exchange:
        """Send a request (its head, and its body if in bytes); the exchange to await."""
        exchange = _Exchange()
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

    def taken(self, exchange: _Exchange) -> None:
        """The reader took ``exchange``'s buffered chunks: resume reading if paused."""
        exchange.buffered = 0
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def reusable(self, exchange: _Exchange) -> bool:
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


async def _wait(future: asyncio.Future[None], timeout: float | None) -> None:
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


class _ResponseStream(ClosesAtOnce):
    """The body as it arrives; closing it before its end aborts the connection."""

    def __init__(
        self,
        pool: Http1Transport,
        connection: _Connection,
        exchange: _Exchange,
        request: httpx.Request,
        read_timeout: float | None,
    ) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self._exchange = exchange
        self._request = request
        self._read_timeout = read_timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange, connection = self._exchange, self._connection
        if connection is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            if exchange.chunks:
                chunks = exchange.chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                connection.taken(exchange)
                yield chunk
                continue
            if exchange.complete:
                self._finish()
                return
            if exchange.error is not None:
                raise _with_request(exchange.error, self._request)
            exchange.waiter = loop.create_future()
            try:
                await _wait(exchange.waiter, self._read_timeout)
            except httpx.TransportError as exc:
                raise _with_request(exc, self._request) from None
            finally:
                exchange.waiter = None

    def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        exchange = self._exchange
        if exchange.complete:  # all of it arrived (read or not): the connection is in step
            exchange.chunks.clear()
            self._pool.release(connection)
        else:  # abandoned mid-body: vLLM must see the client go
            connection.abort()
            self._pool.forget(connection)


def _with_request(error: httpx.TransportError, request: httpx.Request) -> httpx.TransportError:
    fresh = type(error)(str(error), request=request)
    return fresh


def _request_head(request: httpx.Request, chunked: bool) -> bytes:
    url = request.url
    target = url.raw_path or b"/"
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), target)]
    for name, value in request.headers.raw:
        lines.append(b"%s: %s\r\n" % (name, value))
    if chunked:
        lines.append(b"transfer-encoding: chunked\r\n")
    lines.append(b"\r\n")
    head = b"".join(lines)
    # A CR or LF inside a name, value or the target would smuggle a header or a request.
    if head.count(b"\n") != len(lines) or head.count(b"\r") != len(lines):
        raise httpx.LocalProtocolError(
            "a request header or target holds a line break", request=request
        )
    return head


class Http1Transport(httpx.AsyncBaseTransport):
    """A pool of at most ``limits.max_connections`` HTTP/1.1 connections per origin (see the
    module docstring)."""

    def __init__(self, *, limits: httpx.Limits, uds: str | None = None) -> None:
        self._max = limits.max_connections
        self._expiry = limits.keepalive_expiry
        self._uds = uds
        self._idle: dict[tuple[bytes, bytes, int], list[_Connection]] = {}
        self._origins: dict[_Connection, tuple[bytes, bytes, int]] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    # -- the pool ------------------------------------------------------------------------------

    async def _acquire(
        self, origin: tuple[bytes, bytes, int], connect_timeout: float | None
    ) -> _Connection:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.lost and (
                self._expiry is None or now - connection.idle_since < self._expiry
            ):
                connection.reused = True
                return connection
            connection.abort()
            self.forget(connection)
        while self._max is not None and len(self._origins) >= self._max:
            if self._evict_idle():
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next()  # pass on the turn this task was given
                raise
            if self._closed:
                raise httpx.ConnectError("the transport is closed")
            idle = self._idle.get(origin)
            if idle:
                return await self._acquire(origin, connect_timeout)
        return await self._connect(origin, connect_timeout)

    def _evict_idle(self) -> bool:
        """Close one idle connection of another origin to make room; whether there was one."""
        for connections in self._idle.values():
            if connections:
                connection = connections.pop(0)
                connection.abort()
                self.forget(connection)
                return True
        return False

    async def _connect(
        self, origin: tuple[bytes, bytes, int], connect_timeout: float | None
    ) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        connection = _Connection()
        self._origins[connection] = origin  # counted while connecting
        try:
            if self._uds is not None:
                opening = loop.create_unix_connection(lambda: connection, self._uds)
            else:
                tls = None
                if scheme == b"https":
                    if self._ssl is None:
                        self._ssl = ssl.create_default_context()
                    tls = self._ssl
                opening = loop.create_connection(
                    lambda: connection, host.decode("ascii"), port, ssl=tls
                )
            await asyncio.wait_for(opening, connect_timeout)
        except asyncio.TimeoutError as exc:
            self.forget(connection)
            raise httpx.ConnectTimeout("timed out connecting to the server") from exc
        except OSError as exc:
            self.forget(connection)
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        except BaseException:
            self.forget(connection)
            raise
        return connection

    def release(self, connection: _Connection) -> None:
        """A connection whose exchange is complete: kept for the next request, or closed."""
        exchange, connection.exchange = connection.exchange, None
        origin = self._origins.get(connection)
        if origin is None or self._closed or exchange is None or not connection.reusable(exchange):
            connection.abort()
            self.forget(connection)
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(origin, []).append(connection)
        self._wake_next()

    def _discard(self, connection: _Connection) -> None:
        """A connection whose exchange failed or was cancelled: aborted, out of the pool."""
        exchange = connection.exchange
        head = None if exchange is None else exchange.head
        if head is not None and head.done() and not head.cancelled():
            head.exception()  # retrieved: asyncio warns of an exception nobody read
        connection.abort()
        self.forget(connection)

    def forget(self, connection: _Connection) -> None:
        if self._origins.pop(connection, None) is not None:
            self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    # -- httpx's interface ---------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("the transport is closed", request=request)
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        origin = (url.raw_scheme, url.raw_host, port)
        timeouts = request.extensions.get("timeout") or {}
        read_timeout: float | None = timeouts.get("read")
        stream: AsyncIterable[bytes] | None = None
        try:
            body: bytes | None = request.content
        except httpx.RequestNotRead:
            body, stream = None, request.stream  # type: ignore[assignment]
        chunked = stream is not None and "content-length" not in request.headers
        head = _request_head(request, chunked)
        for attempt in (0, 1):
            try:
                connection = await self._acquire(origin, timeouts.get("connect"))
            except httpx.TransportError as exc:
                raise _with_request(exc, request) from exc
            try:
                exchange = connection.start(head, body)
                if stream is not None:
                    await _send_stream(connection, stream, chunked)
                if exchange.head is not None:
                    await _wait(exchange.head, read_timeout)
            except httpx.TransportError as exc:
                answered = connection.exchange is not None and connection.exchange.received > 0
                self._discard(connection)
                if (
                    attempt == 0
                    and connection.reused
                    and stream is None
                    and not answered
                    and not isinstance(exc, httpx.TimeoutException)
                ):
                    continue  # the server closed a kept-alive connection as we reused it
                raise _with_request(exc, request) from exc
            except BaseException:
                self._discard(connection)
                raise
            break
        if request.method == "HEAD":  # no body follows, whatever Content-Length says
            exchange.complete = True
            connection.lost = True  # and the parser expects one: not reused
        extensions: dict[str, object] = {"http_version": b"HTTP/1.1"}
        if exchange.reason:
            extensions["reason_phrase"] = exchange.reason
        return httpx.Response(
            exchange.status,
            headers=exchange.headers,
            stream=_ResponseStream(self, connection, exchange, request, read_timeout),
            request=request,
            extensions=extensions,
        )

    async def aclose(self) -> None:
        """Close every connection, idle or in use (a response still open fails), and return
        once their sockets are closed."""
        self._closed = True
        connections = list(self._origins)
        for connection in connections:  # a response still being read fails
            connection.shut(httpx.ReadError("the connection pool was closed"))
        self._idle.clear()
        self._origins.clear()
        while self._waiters:  # requests waiting for a connection fail now
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        for connection in connections:
            await connection.wait_closed()


async def _send_stream(
    connection: _Connection, stream: AsyncIterable[bytes], chunked: bool
) -> None:
    """Write a streamed request body (chunked unless its length was declared)."""
    transport = connection.transport
    if transport is None:
        raise httpx.WriteError("not connected")
    async for chunk in stream:
        if connection.lost:
            raise httpx.WriteError("the server closed the connection")
        if not chunk:
            continue
        if chunked:
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        else:
            transport.write(chunk)
    if chunked:
        transport.write(b"0\r\n\r\n")
