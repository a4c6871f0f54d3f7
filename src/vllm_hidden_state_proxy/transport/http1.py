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
  with them; the rest streams as it arrives (at most ``HIGH_WATER`` bytes buffered: then the
  socket is paused), ``Content-Length``, chunked or until the connection closes;
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
- a head larger than ``MAX_HEAD_BYTES``, a malformed message, a body cut short or a reset
  connection arrive as httpx's errors (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``ReadError``, ``RemoteProtocolError``), which the proxy maps to 502/504;
- ``uds`` connects over a Unix domain socket (``vllm serve --uds``); ``https`` URLs get TLS with
  the default context.

HTTP/1.1 only: vLLM's OpenAI server (uvicorn) speaks nothing else. One connection (its
protocol, the response as it arrives, ``MAX_HEAD_BYTES``, ``HIGH_WATER``) is
:mod:`.http1_connection`; the pool, the request's bytes and httpx's interface are here.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator

import anyio
import httpx

from vllm_hidden_state_proxy.transport.closing import ClosesAtOnce
from vllm_hidden_state_proxy.transport.http1_connection import (
    Connection,
    Exchange,
    wait_for_reply,
)


class _ResponseStream(ClosesAtOnce):
    """The body as it arrives; closing it before its end aborts the connection."""

    def __init__(
        self,
        pool: Http1Transport,
        connection: Connection,
        exchange: Exchange,
        request: httpx.Request,
        read_timeout: float | None,
    ) -> None:
        self._pool = pool
        self._connection: Connection | None = connection
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
                await wait_for_reply(exchange.waiter, self._read_timeout)
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
        self._idle: dict[tuple[bytes, bytes, int], list[Connection]] = {}
        self._origins: dict[Connection, tuple[bytes, bytes, int]] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    # -- the pool ------------------------------------------------------------------------------

    async def _acquire(
        self, origin: tuple[bytes, bytes, int], connect_timeout: float | None
    ) -> Connection:
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
    ) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        connection = Connection()
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
            # anyio's deadline: asyncio.wait_for (3.10, 3.11) can swallow a cancellation that
            # comes as the connection opens.
            with anyio.fail_after(connect_timeout):
                await opening
        except TimeoutError as exc:
            self.forget(connection)
            raise httpx.ConnectTimeout("timed out connecting to the server") from exc
        except OSError as exc:
            self.forget(connection)
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        except BaseException:
            self.forget(connection)
            raise
        return connection

    def release(self, connection: Connection) -> None:
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

    def _discard(self, connection: Connection) -> None:
        """A connection whose exchange failed or was cancelled: aborted, out of the pool."""
        exchange = connection.exchange
        head = None if exchange is None else exchange.head
        if head is not None and head.done() and not head.cancelled():
            head.exception()  # retrieved: asyncio warns of an exception nobody read
        connection.abort()
        self.forget(connection)

    def forget(self, connection: Connection) -> None:
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
                    await wait_for_reply(exchange.head, read_timeout)
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


async def _send_stream(connection: Connection, stream: AsyncIterable[bytes], chunked: bool) -> None:
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
