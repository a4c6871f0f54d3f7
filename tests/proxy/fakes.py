"""Test doubles for the proxy: a fake vLLM (an ``httpx.MockTransport`` handler) that publishes
like the worker hook, a fake ring source, and drivers for the app.

The fake model has ``FINAL`` decoder layers and ``HIDDEN_SIZE``-d vectors. Every vector is
derived from its request key, layer and pooling (:func:`vector_for`), exactly in float32, so a
test can say which vector a response must carry.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette

from tests.ring.helpers import make_writer
from vllm_hidden_state_proxy.protocol import (
    LAYERS_ENTRY,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    prompt_key,
    request_key_from_wire,
)
from vllm_hidden_state_proxy.proxy import ProxySettings, create_app
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.request_fields import is_token_ids
from vllm_hidden_state_proxy.ring import (
    EngineFailure,
    ErrorRecord,
    Found,
    PendingRows,
    PublishMarks,
    Record,
    RingHeader,
    RingShape,
    RingWriter,
    slot_size_for,
)

UPSTREAM = "http://vllm.test:8000"
HIDDEN_SIZE = 8
#: The fake model's decoder layer count N: layer N (or -1) is the final layer.
FINAL = 4
#: What a server started with ``--hidden-state-layers 0,2,-1`` captures.
LAYERED = (0, 2, FINAL)
MODEL = "m"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


# ---------------------------------------------------------------------------------------------
# vectors and records
# ---------------------------------------------------------------------------------------------


def vector_for(key: bytes, layer: int = FINAL, pooling: str = "last") -> list[float]:
    """The vector the fake hook publishes for ``key`` (exact in float32)."""
    offset = 1000.0 * layer + (0.5 if pooling == "mean" else 0.0)
    return [float(b) - 128.0 + offset for b in key[:HIDDEN_SIZE]]


def vector_bytes(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def record_for(
    key: bytes,
    layers: Sequence[int] = (FINAL,),
    pooling: str = "last",
    *,
    position: int = 4,
    num_prompt_tokens: int = 5,
) -> Record:
    vectors = b"".join(vector_bytes(vector_for(key, layer, pooling)) for layer in layers)
    return Record(
        key, MODEL, position, num_prompt_tokens, pooling, tuple(layers), HIDDEN_SIZE, vectors
    )


def ring_shape(layers: tuple[int, ...] = (FINAL,), slot_count: int = 1024) -> RingShape:
    slot_size = slot_size_for(HIDDEN_SIZE, len(layers), MODEL)
    return RingShape(slot_count, slot_size, HIDDEN_SIZE, FINAL, layers)


#: A real ring of the fake model, as the worker hook creates it (instance 1).
create_writer = functools.partial(
    make_writer,
    hidden_size=HIDDEN_SIZE,
    model=MODEL,
    slot_count=16,
    instance=1,
    num_hidden_layers=FINAL,
    arena_size=1 << 20,
)


# ---------------------------------------------------------------------------------------------
# what the proxy sent
# ---------------------------------------------------------------------------------------------


def sent_document(request: httpx.Request) -> dict[str, Any]:
    document = json.loads(request.content)
    assert isinstance(document, dict)
    return document


def forwarded_key(request: httpx.Request) -> bytes:
    """The request key the proxy put into a forwarded request (asserts it is well formed)."""
    wire = sent_document(request)["vllm_xargs"][REQUEST_KEY_ENTRY]
    key = request_key_from_wire(wire)
    assert key is not None, wire
    return key


def wanted_of(request: httpx.Request) -> tuple[tuple[int, ...], str]:
    """(layers, pooling) a forwarded request asks the hook for, as the hook reads them."""
    xargs = sent_document(request).get("vllm_xargs") or {}
    layers = tuple(xargs.get(LAYERS_ENTRY) or (FINAL,))
    return layers, str(xargs.get(POOLING_ENTRY, "last"))


# ---------------------------------------------------------------------------------------------
# the fake ring source and the fake hook
# ---------------------------------------------------------------------------------------------


@dataclass
class FakeRing:
    """Stands in for ``RingDirectory`` (the ``RingSource`` protocol); counts lookups."""

    present: bool = True
    layers: tuple[int, ...] = (FINAL,)
    slots: int = 1024
    records: dict[bytes, Found] = field(default_factory=dict)
    failures: tuple[EngineFailure, ...] = ()
    #: ``refusal`` answers this (why the directory is refused).
    refused: str | None = None
    instance: int = 1
    #: A lookup returns a record for another key (a proxy must never use it).
    wrong_key: bool = False
    #: ``overwritten_since`` answers this.
    overwritten: bool = False
    lookups: int = 0
    closed: bool = False
    #: What the live ring's header says its hook wraps.
    runner: str = "vLLM 0.32.0 V1 CPUModelRunner"

    def publish(self, found: Found) -> None:
        self.records[found.key] = found

    def lookup(self, key: bytes) -> Found | None:
        self.lookups += 1
        if self.wrong_key:
            return record_for(bytes(reversed(key)))
        return self.records.get(key)

    def find(self, key: bytes) -> Found | PendingRows | None:
        return self.lookup(key)

    def has_ring(self) -> bool:
        return self.present

    def live_ring_count(self) -> int:
        return 1 if self.present else 0

    def live_shapes(self) -> tuple[RingShape, ...]:
        return (ring_shape(self.layers, self.slots),) if self.present else ()

    def live_headers(self) -> tuple[RingHeader, ...]:
        shapes = self.live_shapes()
        return tuple(RingHeader(shape, 1, 1, 0, self.instance, self.runner) for shape in shapes)

    def failed_engines(self) -> tuple[EngineFailure, ...]:
        return self.failures

    def refusal(self) -> str | None:
        return self.refused

    def publishing_instances(self) -> frozenset[int]:
        return frozenset({self.instance}) if self.present else frozenset()

    def publish_marks(self) -> PublishMarks:
        return {}

    def overwritten_since(self, marks: PublishMarks) -> bool:
        return self.overwritten

    def smallest_slot_count(self) -> int | None:
        return self.slots if self.present else None

    def close(self) -> None:
        self.closed = True


#: Where a fake vLLM publishes: a real ring (through its writer) or a fake one.
Hook = RingWriter | FakeRing | None


def publish(hook: Hook, found: Found) -> None:
    if hook is None:
        return
    if isinstance(hook, FakeRing):
        hook.publish(found)
    elif isinstance(found, ErrorRecord):
        hook.publish_error(found.key, found.message, found.status)
    else:
        hook.publish(
            found.key,
            bytes(found.vectors),
            position=found.position,
            num_prompt_tokens=found.num_prompt_tokens,
            layers=found.layers,
            pooling=found.pooling,
            rows=found.rows,
        )


def publish_for(hook: Hook, request: httpx.Request) -> bytes:
    """Publish what the worker hook would for a flagged ``request``; its key. A prompt list sent
    as one request (its marker in ``vllm_xargs``) gets a record per prompt, under the prompt's
    key, with a token-id prompt's length."""
    key = forwarded_key(request)
    layers, pooling = wanted_of(request)
    xargs = sent_document(request).get("vllm_xargs") or {}
    size = xargs.get(LIST_SIZE_ENTRY)
    if not isinstance(size, int):
        prompt = sent_document(request).get("prompt")
        if isinstance(prompt, list) and is_token_ids(prompt):  # its record has its length
            count = len(prompt)
            record = record_for(key, layers, pooling, position=count - 1, num_prompt_tokens=count)
        else:
            record = record_for(key, layers, pooling)
        publish(hook, record)
        return key
    counts = xargs.get(LIST_TOKENS_ENTRY) or [5] * size
    for index, count in enumerate(counts):
        record = record_for(
            prompt_key(key, index), layers, pooling, position=count - 1, num_prompt_tokens=count
        )
        publish(hook, record)
    return key


def is_keyed(request: httpx.Request) -> bool:
    return REQUEST_KEY_ENTRY.encode() in request.content


# ---------------------------------------------------------------------------------------------
# the fake vLLM
# ---------------------------------------------------------------------------------------------


def completion(kv: dict[str, Any] | None = None, content: str = "hi") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
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


def publishing_handler(hook: Hook, response_kv: dict[str, Any] | None = None) -> Handler:
    """A chat endpoint that, like vLLM with the worker hook, publishes the request's record."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if is_keyed(request):
            publish_for(hook, request)
        return httpx.Response(200, json=completion(response_kv))

    return handle


# ---------------------------------------------------------------------------------------------
# driving the app
# ---------------------------------------------------------------------------------------------


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
    """The proxy app in front of ``vllm``, lifespan running, with an in-process client.

    Without ``ring`` the app opens a real ``RingDirectory`` of ``settings.ring_dir``.
    """
    transport = vllm.transport if isinstance(vllm, FakeVLLM) else vllm
    app = create_app(settings, transport, ring=ring)
    async with running(app) as client:
        yield Proxy(client, app)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object, checking the exact shape."""
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code
    assert isinstance(error["message"], str) and error["message"]
    return error


@dataclass
class AsgiCall:
    """Drive an ASGI app directly (no client buffering) and record what it sends."""

    app: Callable[..., Awaitable[None]]
    messages: list[MutableMapping[str, Any]] = field(default_factory=list)

    @staticmethod
    def scope(
        method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> dict[str, Any]:
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
            "headers": headers or [],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)

    @property
    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m["body"]]

    @property
    def status(self) -> int | None:
        for m in self.messages:
            if m["type"] == "http.response.start":
                return int(m["status"])
        return None
