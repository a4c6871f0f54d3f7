"""Test doubles for the proxy: a fake vLLM (httpx.MockTransport handler), ring helpers, drivers."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, request_key_from_wire
from vllm_hidden_state_proxy.proxy import ProxySettings, create_app
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.ring import RingWriter

UPSTREAM = "http://vllm.test:8000"
HIDDEN_SIZE = 8

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def vector_for(key: bytes) -> list[float]:
    """The vector the fake worker publishes for ``key`` (exact in float32)."""
    return [float(b) - 128.0 for b in key[:HIDDEN_SIZE]]


def vector_bytes(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def forwarded_key(request: httpx.Request) -> bytes:
    """The key the proxy injected into a forwarded request (asserts it is well formed)."""
    document = json.loads(request.content)
    wire = document["vllm_xargs"][REQUEST_KEY_ENTRY]
    key = request_key_from_wire(wire)
    assert key is not None, wire
    return key


def completion(kv: dict[str, Any] | None = None, content: str = "hi") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "kv_transfer_params": kv,
    }


@dataclass
class FakeVLLM:
    """Records every request it receives and answers through ``handler``."""

    handler: Handler
    requests: list[httpx.Request] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = await self.handler(request)
        if response.is_stream_consumed:
            # httpx reads in-memory bodies eagerly; a network transport never does. Re-wrap the
            # body as an unread stream so the proxy sees what a real vLLM response looks like.
            return httpx.Response(
                response.status_code,
                headers=response.headers,
                stream=httpx.ByteStream(response.content),
            )
        return response

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def publishing_handler(
    writer: RingWriter | None, response_kv: dict[str, Any] | None = None
) -> Handler:
    """A chat endpoint that, like vLLM + the worker hook, publishes the vector for the key."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if REQUEST_KEY_ENTRY.encode() not in request.content:  # an ordinary request
            return httpx.Response(200, json=completion(response_kv))
        key = forwarded_key(request)
        if writer is not None:
            writer.publish(key, vector_bytes(vector_for(key)), position=4, num_prompt_tokens=5)
        return httpx.Response(200, json=completion(response_kv))

    return handle


@dataclass
class FakeRecord:
    key: bytes
    values: list[float]

    def as_floats(self) -> list[float]:
        return list(self.values)


@dataclass
class FakeRing:
    """Stands in for RingDirectory; counts lookups."""

    present: bool = True
    records: dict[bytes, FakeRecord] = field(default_factory=dict)
    lookups: int = 0
    wrong_key: bool = False

    published: int = 0
    slots: int | None = 1024

    def has_ring(self) -> bool:
        return self.present

    def publish_count(self) -> int:
        return self.published

    def min_slot_count(self) -> int | None:
        return self.slots if self.present else None

    def hidden_size(self) -> int | None:
        return HIDDEN_SIZE if self.present else None

    def lookup(self, key: bytes) -> FakeRecord | None:
        self.lookups += 1
        if self.wrong_key:
            return FakeRecord(bytes(16), [1.0])
        return self.records.get(key)

    def close(self) -> None:
        pass


def settings_for(ring_dir: str, **overrides: Any) -> ProxySettings:
    values: dict[str, Any] = {"upstream_url": UPSTREAM, "ring_dir": ring_dir}
    values.update(overrides)
    return ProxySettings(**values)


@asynccontextmanager
async def running(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan and yield a client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
            yield client


@dataclass
class Proxy:
    client: httpx.AsyncClient
    app: Starlette

    @property
    def metrics(self) -> ProxyMetrics:
        metrics: ProxyMetrics = self.app.state.proxy.metrics
        return metrics


@asynccontextmanager
async def proxy_client(
    settings: ProxySettings,
    vllm: FakeVLLM | httpx.AsyncBaseTransport | None,
    ring: FakeRing | None = None,
) -> AsyncIterator[Proxy]:
    """The proxy app in front of ``vllm``, lifespan running, with an in-process client."""
    transport = vllm.transport if isinstance(vllm, FakeVLLM) else vllm
    app = create_app(settings, transport, ring=ring)
    async with running(app) as client:
        yield Proxy(client, app)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object, checking the exact shape."""
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code
    assert isinstance(error["message"], str) and error["message"]
    return error


@dataclass
class AsgiCall:
    """Drive the ASGI app directly (no client buffering) and record what it sends."""

    app: Starlette
    messages: list[MutableMapping[str, Any]] = field(default_factory=list)

    def scope(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }

    @property
    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m["body"]]

    @property
    def status(self) -> int | None:
        for m in self.messages:
            if m["type"] == "http.response.start":
                return int(m["status"])
        return None
