"""A client that goes away cancels the upstream request and closes the upstream response."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.server import server_config

from tests.proxy.fakes import AsgiCall, FakeRing, FakeVLLM, settings_for

pytestmark = pytest.mark.anyio


class SlowStream(httpx.AsyncByteStream):
    """An endless SSE stream from 'vLLM' that records how it ends."""

    def __init__(self) -> None:
        self.chunks_sent = 0
        self.cancelled = False
        self.closed = anyio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: tick\n\n"
                self.chunks_sent += 1
                await anyio.sleep(0.02)
        except BaseException:  # CancelledError (task cancelled) or GeneratorExit (closed)
            self.cancelled = True
            raise

    async def aclose(self) -> None:
        self.closed.set()


async def test_client_disconnect_cancels_streaming_upstream_under_uvicorn() -> None:
    stream = SlowStream()

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=FakeRing())
    config = uvicorn.Config(
        app, http="httptools", lifespan="on", log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        with anyio.fail_after(5):
            while not server.started:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"messages": [], "stream": true}'
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
            head = await reader.readuntil(b"data: tick\n\n")
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()  # the client goes away mid-stream
            await stream.closed.wait()
        assert stream.cancelled
        sent_at_close = stream.chunks_sent
        await asyncio.sleep(0.1)
        assert stream.chunks_sent == sent_at_close  # nobody keeps pulling from vLLM
    finally:
        server.should_exit = True
        with anyio.move_on_after(5):
            await serving
        serving.cancel()
        sock.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            b'{"messages": [], "kv_transfer_params": {"return_last_hidden_state": true}}',
        ),
        ("/v1/completions", b'{"prompt": "x"}'),
    ],
    ids=["flagged", "ordinary"],
)
async def test_client_disconnect_cancels_pending_upstream_request(path: str, body: bytes) -> None:
    """Non-streaming: vLLM is still generating when the client leaves."""
    started = anyio.Event()
    outcome: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        started.set()
        try:
            await anyio.sleep_forever()
        except BaseException:
            outcome.append("cancelled")
            raise
        raise AssertionError("unreachable")

    ring = FakeRing()
    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=ring)
    call = AsgiCall(app)
    delivered_body = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered_body
        if not delivered_body:
            delivered_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await started.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        call.messages.append(message)

    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await app(call.scope("POST", path, []), receive, send)

    assert outcome == ["cancelled"]
    assert call.messages == []  # nothing sent to a client that is gone
    assert ring.lookups == 0


def test_server_config_uses_fast_stack() -> None:
    config = server_config(settings_for("/unused"), "127.0.0.1", 8123)
    assert (config.loop, config.http, config.access_log) == ("uvloop", "httptools", False)
    assert config.timeout_graceful_shutdown is not None and config.timeout_graceful_shutdown <= 10
    assert (config.host, config.port) == ("127.0.0.1", 8123)
