"""The proxy's own HTTP/1.1 engine (transport/http1.py, transport/http1_connection.py) against
real sockets: the raw server of ``raw_server.py`` records what arrives and replies as each test
tells it, well or badly.

What the proxy relies on: exactly the client's headers go out; body chunks come back as they
arrive; a complete response returns its connection to the pool and anything else (a stream
closed early, a cancelled request, an error, ``Connection: close``, a second response) never
does; a hostile or broken server's reply (a malformed or huge head, bad chunked framing, a
reset) arrives as httpx's errors; the pool keeps its bound; the timeouts are the request's.
No test waits a fixed time: each waits for a state (a request seen, a chunk read, an EOF).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.transport.raw_server import LIMITS, Reply, reply_ok, request, serving
from vllm_hidden_state_proxy.processes import free_port
from vllm_hidden_state_proxy.transport.http1 import Http1Transport
from vllm_hidden_state_proxy.transport.http1_connection import MAX_HEAD_BYTES

pytestmark = pytest.mark.anyio

Writer = asyncio.StreamWriter
Reader = asyncio.StreamReader


def replying(raw: bytes) -> Reply:
    """A reply of exactly these bytes."""

    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(raw)
        await writer.drain()

    return reply


async def body_of(response: httpx.Response) -> bytes:
    try:
        return b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
    finally:
        await response.aclose()


async def exchange(transport: Http1Transport, url: str, body: bytes = b"", **kw: float) -> bytes:
    with anyio.fail_after(30):
        return await body_of(await transport.handle_async_request(request(url, body, **kw)))


async def test_exactly_the_clients_headers_go_out_and_the_body_comes_back() -> None:
    transport = Http1Transport(limits=LIMITS)
    async with serving(reply_ok) as (url, server):
        try:
            response = await transport.handle_async_request(request(url, b'{"a": 1}'))
            content = await body_of(response)
        finally:
            await transport.aclose()
    assert (response.status_code, content) == (200, b'{"a": 1}')
    assert response.headers["x-echo"] == "1" and response.reason_phrase == "OK"
    lines = server.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    names = sorted(line.split(b":", 1)[0].lower() for line in lines[1:] if line)
    assert names == [b"content-length", b"content-type", b"host", b"x-request-id"]


async def test_a_streamed_request_body_goes_out_chunked() -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b"one,"
        yield b""
        yield b"two"

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply_ok) as (url, server):
        try:
            built = httpx.Request("POST", url + "/v1/x", content=parts())
            built.extensions["timeout"] = {"connect": 5.0, "read": 30.0}
            assert await body_of(await transport.handle_async_request(built)) == b"one,two"
        finally:
            await transport.aclose()
    assert b"transfer-encoding: chunked" in server.heads[0].lower()
    assert server.bodies == [b"one,two"]


async def test_chunks_arrive_as_sent_and_a_complete_body_keeps_the_connection() -> None:
    """A streamed reply: the second chunk is sent only once the client has read the first."""
    first_read = asyncio.Event()

    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await first_read.wait()
        first_read.clear()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, server):
        try:
            for _ in range(2):
                with anyio.fail_after(30):  # an engine that buffers bodies would wait forever
                    response = await transport.handle_async_request(request(url))
                    chunks = []
                    async for chunk in response.stream:  # type: ignore[union-attr]
                        chunks.append(chunk)
                        if len(chunks) == 1:
                            first_read.set()
                    await response.aclose()
                assert b"".join(chunks) == b"firstsecond" and chunks[0] == b"first"
        finally:
            await transport.aclose()
    assert server.connections == 1  # the second request reused the first's connection


async def test_a_body_beyond_the_buffer_comes_back_whole() -> None:
    """Several times the engine's buffer: it pauses reading, and resumes as the reader takes."""
    big = bytes(range(256)) * 8192  # 2 MiB
    transport = Http1Transport(limits=LIMITS)
    async with serving(
        replying(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
    ) as (
        url,
        server,
    ):
        try:
            assert await exchange(transport, url) == big
            assert await exchange(transport, url) == big
        finally:
            await transport.aclose()
    assert server.connections == 1


async def test_a_stream_closed_early_drops_the_connection() -> None:
    """A client disconnect mid-stream: vLLM must see its connection end (and abort)."""

    async def endless(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # until the client goes: EOF

    transport = Http1Transport(limits=LIMITS)
    async with serving(endless) as (url, server):
        try:
            response = await transport.handle_async_request(request(url))
            async for _ in response.stream:  # type: ignore[union-attr]
                break
            await response.aclose()
            await asyncio.wait_for(server.closed.wait(), 30)
        finally:
            await transport.aclose()
    assert server.closed.is_set()


async def test_a_request_cancelled_before_its_reply_closes_its_connection() -> None:
    """Cancelled while waiting for the head: the connection ends (vLLM aborts) and the next
    request goes out on a fresh one, never on the one that may still get the old reply."""
    calls = 0

    async def slow_then_ok(reader: Reader, writer: Writer, body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await reader.read()  # no reply: until the client goes
            return
        await reply_ok(reader, writer, body)

    transport = Http1Transport(limits=LIMITS)
    async with serving(slow_then_ok) as (url, server):
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(transport.handle_async_request, request(url))
                await asyncio.wait_for(server.head_seen.wait(), 30)
                tasks.cancel_scope.cancel()
            await asyncio.wait_for(server.closed.wait(), 30)
            assert await exchange(transport, url, b"again") == b"again"
        finally:
            await transport.aclose()
    assert server.connections == 2


async def test_a_request_cancelled_mid_body_closes_its_connection() -> None:
    async def endless(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()
        await reader.read()

    transport = Http1Transport(limits=LIMITS)
    got_part = asyncio.Event()

    async def read_forever() -> None:
        response = await transport.handle_async_request(request(url))
        try:
            async for _ in response.stream:  # type: ignore[union-attr]
                got_part.set()
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async with serving(endless) as (url, server):
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read_forever)
                await asyncio.wait_for(got_part.wait(), 30)
                tasks.cancel_scope.cancel()
            await asyncio.wait_for(server.closed.wait(), 30)
        finally:
            await transport.aclose()
    assert transport._origins == {} and transport._idle == {}


async def test_a_complete_body_read_in_part_keeps_the_connection() -> None:
    """The whole response arrived; the reader stopped after its first bytes: the connection is
    in step and serves the next request."""
    transport = Http1Transport(limits=LIMITS)
    async with serving(reply_ok) as (url, server):
        try:
            response = await transport.handle_async_request(request(url, b"abc"))
            await response.aclose()  # unread
            assert await exchange(transport, url, b"next") == b"next"
        finally:
            await transport.aclose()
    assert server.connections == 1


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["connection-close", "http-1.0"],
)
async def test_a_response_that_ends_the_connection_is_not_reused(head: bytes) -> None:
    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(head)
        await writer.drain()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, server):
        try:
            assert await exchange(transport, url) == b"ok"
            assert await exchange(transport, url) == b"ok"
        finally:
            await transport.aclose()
    assert server.connections == 2


async def test_a_body_delimited_by_the_close_is_read_to_its_end() -> None:
    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, _):
        try:
            assert await exchange(transport, url) == b"until the end"
        finally:
            await transport.aclose()
    assert transport._origins == {}


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"),
        ("POST", b"HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n"),
        ("POST", b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"),
    ],
    ids=["head", "204", "304"],
)
async def test_responses_without_a_body_end_at_their_head(method: str, raw: bytes) -> None:
    transport = Http1Transport(limits=LIMITS)
    async with serving(replying(raw)) as (url, server):
        try:
            for _ in range(2):
                built = request(url)
                built.method = method
                with anyio.fail_after(30):
                    response = await transport.handle_async_request(built)
                    assert await body_of(response) == b""
                assert response.headers.get("content-length", "9") == "9"
        finally:
            await transport.aclose()
    # 204 and 304 keep the connection; a HEAD's is not reused (the parser expects a body).
    assert server.connections == (2 if method == "HEAD" else 1)


async def test_an_informational_response_is_skipped_for_the_final_one() -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\nX-Final: 1\r\n\r\ndone"
    )
    transport = Http1Transport(limits=LIMITS)
    async with serving(replying(raw)) as (url, _):
        try:
            response = await transport.handle_async_request(request(url))
            assert await body_of(response) == b"done"
        finally:
            await transport.aclose()
    assert response.status_code == 201 and response.reason_phrase == "Created"
    assert "link" not in response.headers and response.headers["x-final"] == "1"


async def test_a_second_response_to_one_request_drops_the_connection() -> None:
    """Bytes beyond the response (a Content-Length too short, a smuggled response): the first
    response stands, whole, and the connection is never reused."""
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 500 Bad\r\nContent-Length: 0\r\n\r\n"
    )
    transport = Http1Transport(limits=LIMITS)
    async with serving(replying(raw)) as (url, server):
        try:
            for _ in range(2):
                response = await transport.handle_async_request(request(url))
                assert (response.status_code, await body_of(response)) == (200, b"ok")
                assert "content-length" in response.headers and len(response.headers) == 1
        finally:
            await transport.aclose()
    assert server.connections == 2


async def test_bytes_on_an_idle_connection_drop_it() -> None:
    async def reply(reader: Reader, writer: Writer, body: bytes) -> None:
        await reply_ok(reader, writer, body)
        writer.write(b"HTTP/1.1 200 OK\r\n")  # nobody asked
        await writer.drain()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, server):
        try:
            assert await exchange(transport, url, b"1") == b"1"
            await asyncio.wait_for(server.closed.wait(), 30)
            assert await exchange(transport, url, b"2") == b"2"
        finally:
            await transport.aclose()
    assert server.connections == 2


HOSTILE_HEADS = {
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad-status": b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    "bad-header-name": b"HTTP/1.1 200 OK\r\nBad Name: 1\r\nContent-Length: 0\r\n\r\n",
    "control-in-value": b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "bad-length": b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nok",
    "length-and-chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "switching-protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    "huge-head": b"HTTP/1.1 200 OK\r\n" + b"X: %s\r\n" % (b"a" * 1000) * (MAX_HEAD_BYTES // 1000),
    "closed-without-reply": b"",
}


@pytest.mark.parametrize("raw", HOSTILE_HEADS.values(), ids=HOSTILE_HEADS.keys())
async def test_a_malformed_head_is_a_protocol_error(raw: bytes) -> None:
    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(raw)
        await writer.drain()
        if not raw:
            writer.close()
        await reader.read()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, server):
        try:
            with anyio.fail_after(30), pytest.raises(httpx.RemoteProtocolError) as caught:
                await transport.handle_async_request(request(url))
            assert caught.value.request.url == url + "/v1/chat/completions"
            await asyncio.wait_for(server.closed.wait(), 30)
        finally:
            await transport.aclose()
    assert transport._origins == {}


HOSTILE_BODIES = {
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n",
    "chunk-without-crlf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX",
    "cut-short": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part",
    "chunked-cut-short": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n",
}


@pytest.mark.parametrize("raw", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
async def test_a_broken_body_is_a_protocol_error(raw: bytes) -> None:
    async def reply(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(raw)
        await writer.drain()
        writer.close()

    transport = Http1Transport(limits=LIMITS)
    async with serving(reply) as (url, _):
        try:
            with anyio.fail_after(30):
                response = await transport.handle_async_request(request(url))
                assert response.status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):
                    await body_of(response)
        finally:
            await transport.aclose()
    assert transport._origins == {}


async def test_a_connection_reset_mid_body_is_a_read_error() -> None:
    async def reset(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(0)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, not a FIN

    transport = Http1Transport(limits=LIMITS)
    async with serving(reset) as (url, _):
        try:
            with anyio.fail_after(30):
                response = await transport.handle_async_request(request(url))
                # An RST may come as a reset (ReadError) or, read after the data, as an end.
                with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                    await body_of(response)
        finally:
            await transport.aclose()
    assert transport._origins == {}


async def test_a_kept_alive_connection_the_server_closed_is_retried_once() -> None:
    """The server's keep-alive timeout races the next request: it closes without a byte; the
    request goes out again on a fresh connection. Nothing else is retried."""
    calls = 0

    async def close_the_second(reader: Reader, writer: Writer, body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            writer.transport.abort()
            return
        await reply_ok(reader, writer, body)

    transport = Http1Transport(limits=LIMITS)
    async with serving(close_the_second) as (url, server):
        try:
            assert await exchange(transport, url, b"1") == b"1"
            assert await exchange(transport, url, b"2") == b"2"
        finally:
            await transport.aclose()
    assert (calls, server.connections) == (3, 2)


async def test_a_fresh_connection_closed_without_reply_is_not_retried() -> None:
    async def close(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.transport.abort()

    transport = Http1Transport(limits=LIMITS)
    async with serving(close) as (url, server):
        try:
            with pytest.raises(httpx.TransportError):
                await exchange(transport, url)
        finally:
            await transport.aclose()
    assert len(server.heads) == 1


async def test_the_pool_keeps_its_bound() -> None:
    """One connection: the second request waits for the first's, then reuses it."""
    release = asyncio.Event()

    async def held(reader: Reader, writer: Writer, body: bytes) -> None:
        if len(held_heads) == 0:
            held_heads.append(body)
            await release.wait()
        await reply_ok(reader, writer, body)

    held_heads: list[bytes] = []
    transport = Http1Transport(limits=httpx.Limits(max_connections=1, keepalive_expiry=5.0))
    async with serving(held) as (url, server):
        try:
            async with anyio.create_task_group() as tasks:
                results: list[bytes] = []

                async def one(body: bytes) -> None:
                    results.append(await exchange(transport, url, body))

                tasks.start_soon(one, b"first")
                await asyncio.wait_for(server.head_seen.wait(), 30)
                tasks.start_soon(one, b"second")
                with anyio.fail_after(30):
                    while not transport._waiters:  # the second waits for the one connection
                        await asyncio.sleep(0)
                assert len(server.heads) == 1 and server.connections == 1
                release.set()
        finally:
            await transport.aclose()
    assert sorted(results) == [b"first", b"second"] and server.connections == 1


async def test_closing_the_transport_fails_the_requests_under_way_and_waiting() -> None:
    async def silent(reader: Reader, writer: Writer, _: bytes) -> None:
        await reader.read()

    transport = Http1Transport(limits=httpx.Limits(max_connections=1, keepalive_expiry=5.0))
    async with serving(silent) as (url, server):
        holding = asyncio.ensure_future(transport.handle_async_request(request(url)))
        await asyncio.wait_for(server.head_seen.wait(), 30)
        waiting = asyncio.ensure_future(transport.handle_async_request(request(url)))
        with anyio.fail_after(30):
            while not transport._waiters:
                await asyncio.sleep(0)
        await transport.aclose()
        with pytest.raises(httpx.ConnectError):
            await asyncio.wait_for(waiting, 30)
        with pytest.raises(httpx.ReadError):  # the request that held the connection fails too
            await asyncio.wait_for(holding, 30)


async def test_closing_the_transport_fails_a_response_being_read() -> None:
    async def endless(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        await writer.drain()
        await reader.read()

    transport = Http1Transport(limits=LIMITS)
    async with serving(endless) as (url, server):
        response = await transport.handle_async_request(request(url))
        await transport.aclose()
        with anyio.fail_after(30), pytest.raises(httpx.ReadError):
            await body_of(response)
        await asyncio.wait_for(server.closed.wait(), 30)


async def test_no_head_within_the_read_timeout_is_a_read_timeout() -> None:
    async def silent(reader: Reader, writer: Writer, _: bytes) -> None:
        await reader.read()

    transport = Http1Transport(limits=LIMITS)
    async with serving(silent) as (url, server):
        try:
            with pytest.raises(httpx.ReadTimeout):
                await transport.handle_async_request(request(url, read=0.2))
            await asyncio.wait_for(server.closed.wait(), 30)  # and the connection is closed
        finally:
            await transport.aclose()
    assert server.head_seen.is_set()


async def test_a_stall_between_body_bytes_is_a_read_timeout() -> None:
    async def stall(reader: Reader, writer: Writer, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        await writer.drain()
        await reader.read()

    transport = Http1Transport(limits=LIMITS)
    async with serving(stall) as (url, server):
        try:
            response = await transport.handle_async_request(request(url, read=0.2))
            with pytest.raises(httpx.ReadTimeout):
                await body_of(response)
            await asyncio.wait_for(server.closed.wait(), 30)
        finally:
            await transport.aclose()


async def test_a_line_break_in_a_header_never_goes_out() -> None:
    transport = Http1Transport(limits=LIMITS)
    async with serving(reply_ok) as (url, server):
        try:
            built = request(url)
            built.headers["x-evil"] = "a\r\nX-Smuggled: 1"
            with pytest.raises(httpx.LocalProtocolError):
                await transport.handle_async_request(built)
        finally:
            await transport.aclose()
    assert server.heads == []


@pytest.mark.parametrize("where", ["tcp", "uds"])
async def test_a_unix_socket_like_tcp(where: str, tmp_path: Path) -> None:
    uds = tmp_path / "vllm.sock" if where == "uds" else None
    transport = Http1Transport(limits=LIMITS, uds=None if uds is None else str(uds))
    async with serving(reply_ok, uds=uds) as (url, server):
        try:
            assert await exchange(transport, url, b"x") == b"x"
        finally:
            await transport.aclose()
    assert len(server.heads) == 1


async def test_nothing_listening_is_a_connect_error() -> None:
    transport = Http1Transport(limits=LIMITS)
    try:
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(request(f"http://127.0.0.1:{free_port()}"))
    finally:
        await transport.aclose()
    assert transport._origins == {}
