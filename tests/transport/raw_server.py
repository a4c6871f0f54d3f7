"""A tiny asyncio HTTP/1.1 server for the engines' tests: it records every request head it
reads (and the body, Content-Length or chunked) and replies as the test tells it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_hidden_state_proxy.processes import free_port

LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=5.0)

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


@dataclass
class Server:
    """Every request head it read, and the connections it saw open and end."""

    reply: Reply
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    head_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break  # the client closed the connection
                body = await _read_body(reader, head)
                self.heads.append(head)
                self.bodies.append(body)
                self.head_seen.set()
                await self.reply(reader, writer, body)
        finally:
            self.closed.set()
            writer.close()


async def reply_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Echo: 1\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()


@contextlib.asynccontextmanager
async def serving(reply: Reply, *, uds: Path | None = None) -> AsyncIterator[tuple[str, Server]]:
    server = Server(reply)
    if uds is None:
        port = free_port()
        listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
    else:
        listener = await asyncio.start_unix_server(server.handle, str(uds))
        url = "http://vllm.uds"
    try:
        yield url, server
    finally:
        listener.close()
        await listener.wait_closed()


def request(url: str, body: bytes = b"", **timeouts: float) -> httpx.Request:
    headers = [(b"Content-Type", b"application/json"), (b"X-Request-Id", b"abc")]
    built = httpx.Request("POST", url + "/v1/chat/completions", headers=headers, content=body)
    built.extensions["timeout"] = {"connect": 5.0, "read": 30.0, **timeouts}
    return built


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
        if line.lower() == b"transfer-encoding: chunked":
            chunks: list[bytes] = []
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await reader.readexactly(size + 2)
                if not size:
                    return b"".join(chunks)
                chunks.append(chunk[:-2])
    return await reader.readexactly(length)
