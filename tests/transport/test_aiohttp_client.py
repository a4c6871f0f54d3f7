"""The engine under the proxy's httpx interface (transport/aiohttp_client.py), against real
sockets: a tiny asyncio HTTP/1.1 server that records what arrives and replies as told.

What the proxy relies on: exactly the client's headers go out; body chunks come back as they
arrive; a stream closed early drops the connection (so vLLM sees the disconnect); a complete
one returns it to the pool; aiohttp's failures arrive as httpx's errors; a Unix socket works.
No test waits a fixed time: each waits for a state (a request seen, a chunk read, an EOF).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import httpx
import pytest

from tests.transport.raw_server import LIMITS, reply_ok, request, serving
from vllm_hidden_state_proxy.processes import free_port
from vllm_hidden_state_proxy.transport.aiohttp_client import AiohttpTransport

pytestmark = pytest.mark.anyio


async def test_exactly_the_clients_headers_go_out_and_the_body_comes_back() -> None:
    transport = AiohttpTransport(limits=LIMITS)
    async with serving(reply_ok) as (url, server):
        try:
            response = await transport.handle_async_request(request(url, b'{"a": 1}'))
            content = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
            await response.aclose()
        finally:
            await transport.aclose()
    assert (response.status_code, content) == (200, b'{"a": 1}')
    assert response.headers["x-echo"] == "1"
    lines = server.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    names = sorted(line.split(b":", 1)[0].lower() for line in lines[1:] if line)
    # Host and the body's length: nothing of aiohttp's own (no User-Agent, Accept, ...).
    assert names == [b"content-length", b"content-type", b"host", b"x-request-id"]


async def test_chunks_arrive_as_sent_and_a_complete_body_keeps_the_connection() -> None:
    """A streamed reply: the second chunk is sent only once the client has read the first."""
    first_read = asyncio.Event()

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await first_read.wait()
        first_read.clear()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    transport = AiohttpTransport(limits=LIMITS)
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


async def test_a_stream_closed_early_drops_the_connection() -> None:
    """A client disconnect mid-stream: vLLM must see its connection end (and abort)."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # until the client goes: EOF

    transport = AiohttpTransport(limits=LIMITS)
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


@pytest.mark.parametrize("where", ["tcp", "uds"])
async def test_a_unix_socket_like_tcp(where: str, tmp_path: Path) -> None:
    uds = tmp_path / "vllm.sock" if where == "uds" else None
    transport = AiohttpTransport(limits=LIMITS, uds=None if uds is None else str(uds))
    async with serving(reply_ok, uds=uds) as (url, server):
        try:
            response = await transport.handle_async_request(request(url, b"x"))
            await response.aread()
            await response.aclose()
        finally:
            await transport.aclose()
    assert response.content == b"x" and len(server.heads) == 1


async def test_nothing_listening_is_a_connect_error() -> None:
    transport = AiohttpTransport(limits=LIMITS)
    try:
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(request(f"http://127.0.0.1:{free_port()}"))
    finally:
        await transport.aclose()


async def test_no_reply_within_the_read_timeout_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> None:
        await reader.read()

    transport = AiohttpTransport(limits=LIMITS)
    async with serving(silent) as (url, server):
        try:
            with pytest.raises(httpx.ReadTimeout):
                await transport.handle_async_request(request(url, read=0.2))
        finally:
            await transport.aclose()
    assert server.head_seen.is_set()  # it was the reply that never came


async def test_a_connection_cut_mid_body_is_a_remote_protocol_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.transport.abort()

    transport = AiohttpTransport(limits=LIMITS)
    async with serving(cut) as (url, _):
        try:
            response = await transport.handle_async_request(request(url))
            with pytest.raises(httpx.RemoteProtocolError):
                async for _chunk in response.stream:  # type: ignore[union-attr]
                    pass
            await response.aclose()
        finally:
            await transport.aclose()


async def test_the_pool_limit_is_the_settings() -> None:
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=7, keepalive_expiry=3.0))
    async with serving(reply_ok) as (url, _):
        try:
            await (await transport.handle_async_request(request(url))).aclose()
            session = transport._session
            assert session is not None
            assert (session.connector.limit, session.connector.limit_per_host) == (7, 0)  # type: ignore[union-attr]
        finally:
            await transport.aclose()
