"""Every other path (proxy/endpoints/__init__.py), and ordinary traffic on the generation paths:
forwarded untouched, streamed back chunk by chunk; only the reserved entries and the flag are
refused."""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import anyio
import httpx
import pytest

from tests.proxy.fakes import (
    AsgiCall,
    FakeRing,
    FakeVLLM,
    error_of,
    proxy_client,
    running,
    settings_for,
)
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, XARGS_PREFIX
from vllm_hidden_state_proxy.proxy import create_app

pytestmark = pytest.mark.anyio


async def test_get_passthrough_bytes_status_headers_query() -> None:
    body = b'{"object":"list","data":[{"id":"m"}]}  \n'

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            203,
            headers=[
                ("content-type", "application/json"),
                ("x-upstream", "yes"),
                ("keep-alive", "timeout=5"),
                ("connection", "x-conn-only"),
                ("x-conn-only", "secret"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2"),
            ],
            content=body,
        )

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/nonexistent"), vllm, FakeRing()) as proxy:
        response = await proxy.client.get(
            "/v1/models?x=1&y=a%20b&z=%2F",
            headers={
                "authorization": "Bearer k",
                "x-client": "c",
                "te": "trailers",
                "proxy-authorization": "Basic x",
                "upgrade": "h2c",
                "connection": "x-hop, keep-alive",
                "x-hop": "drop me",
                "keep-alive": "timeout=1",
            },
        )

    assert response.status_code == 203
    assert response.content == body
    assert response.headers["x-upstream"] == "yes"
    assert response.headers.get_list("set-cookie") == ["a=1", "b=2"]
    for hop in ("keep-alive", "connection", "x-conn-only"):
        assert hop not in response.headers

    (forwarded,) = vllm.requests
    assert forwarded.method == "GET"
    assert str(forwarded.url) == "http://vllm.test:8000/v1/models?x=1&y=a%20b&z=%2F"
    assert forwarded.headers["host"] == "vllm.test:8000"
    assert forwarded.headers["authorization"] == "Bearer k"
    assert forwarded.headers["x-client"] == "c"
    for hop in ("te", "proxy-authorization", "upgrade", "connection", "x-hop", "keep-alive"):
        assert hop not in forwarded.headers, hop
    assert forwarded.content == b""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "x",   "max_tokens": 3}'),
        ("/tokenize", bytes(range(256)) * 10),
        # Mentions the flag name, is valid JSON, but is not flagged: forwarded byte-identical.
        (
            "/v1/chat/completions",
            b'{ "messages" : [ {"role":"user","content":"what is return_last_hidden_state?"} ],'
            b' "max_tokens": 1.50e1 }',
        ),
        ("/v1/chat/completions", b'{"messages": [], "kv_transfer_params": {"other": 1}}'),
    ],
)
async def test_post_body_forwarded_byte_identical(path: str, body: bytes) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"echo:" + request.content)

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/nonexistent"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(path, content=body)
        assert proxy.metrics.requests == {"ordinary": 1, "flagged": 0, "embeddings": 0}

    assert response.status_code == 200
    assert response.content == b"echo:" + body
    (forwarded,) = vllm.requests
    assert forwarded.method == "POST"
    assert forwarded.url.path == path
    assert forwarded.content == body
    assert forwarded.headers["content-length"] == str(len(body))


async def test_other_methods_on_special_paths_pass_through() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(405, content=f"{request.method} {request.url.path}".encode())

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/nonexistent"), vllm, FakeRing()) as proxy:
        chat = await proxy.client.get("/v1/chat/completions")
        health = await proxy.client.delete("/health")

    assert (chat.status_code, chat.content) == (405, b"GET /v1/chat/completions")
    assert (health.status_code, health.content) == (405, b"DELETE /health")


async def test_streaming_chunks_relayed_in_order_without_buffering() -> None:
    """Each upstream chunk reaches the client before the next one is even produced."""
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    delivered = [anyio.Event() for _ in chunks]

    async def produce() -> AsyncIterator[bytes]:
        for i, chunk in enumerate(chunks):
            yield chunk
            with anyio.fail_after(2):  # would time out if the proxy buffered the stream
                await delivered[i].wait()

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    app = create_app(settings_for("/nonexistent"), FakeVLLM(handle).transport, ring=FakeRing())
    call = AsgiCall(app)
    request_body = b'{"messages": [], "stream": true}'
    pending: list[dict[str, Any]] = [{"type": "http.request", "body": request_body}]
    finished = anyio.Event()

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        await call.send(message)
        if message["type"] == "http.response.body" and message["body"]:
            delivered[len(call.body_chunks) - 1].set()

    async with app.router.lifespan_context(app):
        scope = call.scope("POST", "/v1/chat/completions", [(b"content-type", b"application/json")])
        with anyio.fail_after(5):
            await app(scope, receive, send)
        finished.set()

    assert call.status == 200
    assert call.body_chunks == chunks
    assert call.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    start = call.messages[0]
    assert (b"content-type", b"text/event-stream") in start["headers"]


async def test_streaming_through_client_in_order() -> None:
    chunks = [f"data: {i}\n\n".encode() for i in range(20)]

    async def produce() -> AsyncIterator[bytes]:
        for chunk in chunks:
            await anyio.sleep(0)
            yield chunk

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    app = create_app(settings_for("/nonexistent"), FakeVLLM(handle).transport, ring=FakeRing())
    async with running(app) as client:
        response = await client.post("/v1/chat/completions", json={"stream": True})
    assert response.content == b"".join(chunks)
    assert response.headers["content-type"] == "text/event-stream"


# ---------------------------------------------------------------------------------------------
# what other paths refuse, and what they leave to vLLM
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/messages",
            b'{"input": "x", "kv_transfer_params": {"return_last_hidden_state": true}}',
            "kv_transfer_params.return_last_hidden_state",
        ),
        (
            "/v1/messages",
            b'{"input": "x", "vllm_xargs": {"' + REQUEST_KEY_ENTRY.encode() + b'": "00"}}',
            "vllm_xargs",
        ),
        (
            "/tokenize",
            b'{"prompt": "x", "vllm_xargs": {"' + XARGS_PREFIX.encode() + b'pooling": "mean"}}',
            "vllm_xargs",
        ),
        (
            "/v1/audio/transcriptions",
            '{"vllm_xargs": {"hidden_state_proxy_key": "00"}}'.encode("utf-16"),
            "vllm_xargs",
        ),
    ],
)
async def test_the_flag_and_reserved_entries_are_refused_on_other_paths(
    path: str, body: bytes, param: str
) -> None:
    """A flagged request must never get a 200 without its vector; reserved entries are the
    proxy's own everywhere."""

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/nonexistent"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(path, content=body)
    assert response.status_code == 400
    assert error_of(response)["param"] == param
    assert vllm.requests == []


async def test_an_unparseable_body_on_other_paths_is_left_to_vllm() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, content=b"vllm says no")

    vllm = FakeVLLM(handle)
    body = b'{"vllm_xargs": {"\\u0068": [}'  # could be read by no one, spells nothing as it is
    spelled = b'{"vllm_xargs": {"' + REQUEST_KEY_ENTRY.encode() + b'": [}'
    async with proxy_client(settings_for("/nonexistent"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post("/v1/messages", content=body)
        assert proxy.metrics.requests["ordinary"] == 1
        # One that spells the prefix as it is cannot be proven harmless: refused.
        refused = await proxy.client.post("/v1/messages", content=spelled)
    assert (response.status_code, response.content) == (422, b"vllm says no")
    assert [request.content for request in vllm.requests] == [body]
    assert refused.status_code == 400


async def test_a_body_over_the_limit_is_413_on_other_paths() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    vllm = FakeVLLM(handle)
    settings = settings_for("/nonexistent", max_body_bytes=10)
    async with proxy_client(settings, vllm, FakeRing()) as proxy:
        response = await proxy.client.post("/tokenize", content=b"x" * 11)
    assert response.status_code == 413
    assert vllm.requests == []
