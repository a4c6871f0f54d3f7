"""A real proxy server for tests that talk HTTP/1.1 over raw sockets (``test_http_abuse.py``,
``test_front_limits.py``): uvicorn with the production options (``server_config``: uvloop,
httptools with the head limits, the connection bound) in a thread, in front of a fake vLLM
behind ``httpx.MockTransport`` that publishes into a real ring, and a raw client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import uvicorn

from tests.proxy.fakes import FakeVLLM, completion, create_writer, publish_for, vector_for
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, request_key_from_wire
from vllm_hidden_state_proxy.proxy import ProxySettings, create_app
from vllm_hidden_state_proxy.proxy.server import server_config
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.ring import RingWriter

LIMIT = 256 * 1024
CHAT = b"/v1/chat/completions"
FLAG = b'"kv_transfer_params": {"return_last_hidden_state": true}'
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
FLAGGED = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], ' + FLAG + b"}"


def injected_key(request: httpx.Request) -> bytes | None:
    try:
        sent = json.loads(request.content)
    except (ValueError, RecursionError):
        return None
    xargs = sent.get("vllm_xargs") if isinstance(sent, dict) else None
    return request_key_from_wire(xargs.get(REQUEST_KEY_ENTRY)) if isinstance(xargs, dict) else None


class ErrorLog(logging.Handler):
    """Collects uvicorn's ERROR records ("Exception in ASGI application", ...)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Served:
    port: int
    upstream: list[httpx.Request]
    errors: ErrorLog
    #: The running server (its ``server_state.connections``: the connections it holds open).
    userver: uvicorn.Server
    #: The app's state (its ``body_budget``).
    state: ProxyState
    seen_before: int = 0
    errors_before: int = 0

    @property
    def new_upstream(self) -> list[httpx.Request]:
        return self.upstream[self.seen_before :]


def fake_vllm(writer: RingWriter, seen: list[httpx.Request], latency: float = 0.0) -> FakeVLLM:
    """Answers like vLLM with the worker hook: publishes the vector for the proxy's key; 400
    for a generation body that is not a JSON object; SSE for ``stream: true``. ``latency``:
    seconds each request takes (vLLM's step), none by default."""

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if latency:
            await asyncio.sleep(latency)
        if request.url.path == "/v1/hop-by-hop":
            headers = {"connection": "x-up", "x-up": "1", "keep-alive": "timeout=5", "x-ok": "1"}
            return httpx.Response(200, headers={**headers, "proxy-authenticate": "Basic"})
        if not request.url.path.startswith("/v1/"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.method != "POST" or request.url.path == "/v1/responses":
            return httpx.Response(200, json={"object": "list", "data": []})
        try:
            document = json.loads(request.content)
        except (ValueError, RecursionError):
            document = None
        if not isinstance(document, dict):
            return httpx.Response(400, json={"error": {"message": "bad JSON", "code": 400}})
        if injected_key(request) is not None:
            publish_for(writer, request)
        if document.get("stream") is True:
            chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
            events = [b"data: " + orjson.dumps(chunk) + b"\n\n", b"data: [DONE]\n\n"]

            async def produce() -> AsyncIterator[bytes]:
                for event in events:
                    yield event

            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=produce()
            )
        return httpx.Response(200, json=completion())

    return FakeVLLM(handle)


# ---------------------------------------------------------------------------------------------
# a raw HTTP/1.1 client
# ---------------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def openai_error(self) -> dict[str, Any]:
        assert self.header(b"content-type") == b"application/json", self
        document = json.loads(self.body)
        assert set(document) == {"error"}
        error: dict[str, Any] = document["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == self.status and error["message"]
        return error


@dataclass
class Raw:
    """One connection: send bytes as they are, read whole replies (content-length, chunked, or
    up to the close). Every read times out: a hang fails the test."""

    port: int
    timeout: float = 10.0
    sock: socket.socket = field(init=False)
    buffer: bytes = b""
    eof: bool = False

    def __post_init__(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)

    def send(self, data: bytes) -> Raw:
        self.sock.sendall(data)
        return self

    def _fill(self) -> bool:
        if self.eof:
            return False
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        self.eof = not chunk
        self.buffer += chunk
        return bool(chunk)

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n and self._fill():
            pass
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise AssertionError(f"connection closed mid-line: {self.buffer!r}")
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def reply(self) -> Reply | None:
        """The next reply (1xx included), or ``None`` if the server closed without one."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                assert not self.buffer, f"closed mid-reply: {self.buffer!r}"
                return None
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.split(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        status = int(status_line.split()[1])
        headers = [(k.strip().lower(), v.strip()) for k, v in (h.split(b":", 1) for h in lines)]
        reply = Reply(status, headers, b"")
        if status < 200:
            return reply
        length = reply.header(b"content-length")
        if length is not None:
            reply.body = self._take(int(length))
            assert len(reply.body) == int(length), "truncated body"
        elif reply.header(b"transfer-encoding") == b"chunked":
            while size := int(self._line().split(b";")[0], 16):
                reply.body += self._take(size)
                assert self._take(2) == b"\r\n"
            while self._line():  # trailers
                pass
        else:
            while self._fill():
                pass
            reply.body, self.buffer = self.buffer, b""
        return reply

    def final_reply(self) -> Reply:
        reply = self.reply()
        while reply is not None and reply.status < 200:
            reply = self.reply()
        assert reply is not None, "closed without a reply"
        return reply

    def closed(self) -> bool:
        """True if the server closes the connection (waits up to the timeout)."""
        while self._fill():
            pass
        return self.eof

    def close(self) -> None:
        self.sock.close()


def request(
    body: bytes = BODY,
    *,
    path: bytes = CHAT,
    method: bytes = b"POST",
    headers: bytes = b"",
    length: bool = True,
) -> bytes:
    """A request as raw bytes; ``headers`` are extra raw header lines (each ending in CRLF)."""
    framing = b"Content-Length: %d\r\n" % len(body) if length else b""
    return (
        method + b" " + path + b" HTTP/1.1\r\nHost: proxy\r\n" + headers + framing + b"\r\n" + body
    )


def chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def exchange(port: int, data: bytes) -> Reply:
    raw = Raw(port).send(data)
    try:
        return raw.final_reply()
    finally:
        raw.close()


def assert_vector_reply(reply: Reply, served: Served) -> None:
    assert reply.status == 200, reply
    key = injected_key(served.new_upstream[-1])
    assert key is not None
    kv = json.loads(reply.body)["kv_transfer_params"]
    assert kv["last_hidden_state"] == vector_for(key)


@contextmanager
def serving(settings: ProxySettings, upstream_latency: float = 0.0) -> Iterator[Served]:
    """uvicorn with ``server_config(settings)`` on a free loopback port, the app in front of
    the fake vLLM (each request taking ``upstream_latency`` seconds) and a real ring in
    ``settings.ring_dir`` (64 slots); stopped at the end."""
    writer = create_writer(settings.ring_dir, slot_count=64)
    seen: list[httpx.Request] = []
    config = server_config(settings)
    vllm = fake_vllm(writer, seen, upstream_latency)
    app = create_app(settings, vllm.transport)  # real RingDirectory
    config.app = app
    errors = ErrorLog()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    userver = uvicorn.Server(config)
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not userver.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        yield Served(sock.getsockname()[1], seen, errors, userver, app.state.proxy)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
        userver.should_exit = True
        thread.join(15)
        sock.close()
        writer.close()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)
