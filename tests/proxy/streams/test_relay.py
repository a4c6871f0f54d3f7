"""Relaying (proxy/streams/relay.py): vLLM's status and headers first, then its body byte for byte;
a body that breaks off after the headers cuts the response instead of completing it."""

from __future__ import annotations

from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    AsgiCall,
    FakeRing,
    FakeVLLM,
    error_of,
    is_keyed,
    proxy_client,
    publish_for,
    settings_for,
)
from vllm_hidden_state_proxy.proxy import create_app

pytestmark = pytest.mark.anyio


async def drive(app: Any, path: str, body: bytes) -> AsgiCall:
    """Run one request through ``app`` (lifespan included) without any client buffering."""
    call = AsgiCall(app)
    pending: list[MutableMapping[str, Any]] = [
        {"type": "http.request", "body": body, "more_body": False}
    ]

    async def receive() -> MutableMapping[str, Any]:
        if pending:
            return pending.pop()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with app.router.lifespan_context(app):
        with anyio.fail_after(60):
            await app(call.scope("POST", path), receive, call.send)
    return call


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"{}"),
        ("/v1/models", b""),
        (
            "/v1/chat/completions",
            b'{"messages": [], "stream": true, '
            b'"kv_transfer_params": {"return_last_hidden_state": true}}',
        ),
    ],
    ids=["ordinary", "passthrough", "flagged-stream"],
)
async def test_a_body_breaking_off_after_the_headers_cuts_the_response(
    path: str, body: bytes
) -> None:
    """The headers are out: the response must end incomplete, never look complete (a flagged
    stream, which the proxy rewrites, ends with an error event instead: see below)."""
    ring = FakeRing()
    first = b'data: {"choices": [{"index": 0}]}\n\n'

    async def produce() -> AsyncIterator[bytes]:
        yield first
        raise httpx.ReadError("vLLM died")

    async def handle(request: httpx.Request) -> httpx.Response:
        if is_keyed(request):
            publish_for(ring, request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=ring)
    call = await drive(app, path, body)
    assert app.state.proxy.metrics.upstream_errors == 1
    assert call.status == 200
    assert call.body_chunks[0].startswith(b'data: {"choices"')
    if b"kv_transfer_params" in body:  # the OpenAI client raises this event
        assert len(call.body_chunks) == 2 and call.messages[-1]["more_body"] is False
        error = orjson.loads(call.body_chunks[1].removeprefix(b"data: "))["error"]
        assert error["code"] == 502 and "broke off" in error["message"]
        return
    assert len(call.body_chunks) == 1
    assert all(m.get("more_body", True) for m in call.messages[1:])  # never completed


async def test_vllms_status_headers_and_body_are_relayed() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            418,
            headers=[("x-a", "1"), ("Transfer-Encoding", "chunked"), ("X-B", "2")],
            content=b"teapot",
        )

    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=FakeRing())
    call = await drive(app, "/v1/completions", b"{}")
    start = call.messages[0]
    assert start["status"] == 418
    assert (b"x-a", b"1") in start["headers"] and (b"x-b", b"2") in start["headers"]
    assert not any(name == b"transfer-encoding" for name, _ in start["headers"])
    assert call.body_chunks == [b"teapot"]
    assert call.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


@pytest.mark.parametrize(
    ("error", "status", "fragment"),
    [
        (httpx.ConnectError("connection refused"), 502, "Could not reach vLLM"),
        (httpx.ConnectTimeout("slow connect"), 502, "Could not reach vLLM"),
        (httpx.ReadTimeout("slow"), 504, "did not answer in time"),
        (httpx.RemoteProtocolError("garbage"), 502, "The exchange with vLLM"),
    ],
)
@pytest.mark.parametrize("flagged", [False, True], ids=["ordinary", "flagged"])
async def test_vllm_failing_before_its_headers(
    error: httpx.TransportError, status: int, fragment: str, flagged: bool
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise error

    ring = FakeRing()
    body: dict[str, Any] = {"messages": []}
    if flagged:
        body["kv_transfer_params"] = {"return_last_hidden_state": True}
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post("/v1/chat/completions", json=body)
        assert proxy.metrics.upstream_errors == 1
    assert response.status_code == status
    message = error_of(response)["message"]
    assert fragment in message and "vllm.test" not in message
    assert ring.lookups == 0


class _HeldBody(httpx.AsyncByteStream):
    """A body whose bytes come only once the test lets them."""

    def __init__(self) -> None:
        self.go = anyio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await self.go.wait()
        yield b'{"a": 1}'


@pytest.mark.parametrize(
    ("headers", "head_at_once"),
    [([("content-length", "8")], False), ([("content-type", "text/event-stream")], True)],
    ids=["json", "stream"],
)
async def test_a_reply_of_known_length_sends_its_head_with_its_first_bytes(
    headers: list[tuple[str, str]], head_at_once: bool
) -> None:
    """So that the front door writes both in one system call (issue #46); a stream's head goes
    out at once, whenever its first event comes."""
    from vllm_hidden_state_proxy.proxy.streams.relay import relay_response

    body = _HeldBody()
    response = httpx.Response(200, headers=headers, stream=body)
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(relay_response, None, send, response)  # type: ignore[arg-type]
        await anyio.wait_all_tasks_blocked()
        assert [m["type"] for m in sent] == (["http.response.start"] if head_at_once else [])
        body.go.set()
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2
    assert sent[1]["body"] == b'{"a": 1}' and sent[0]["status"] == 200
