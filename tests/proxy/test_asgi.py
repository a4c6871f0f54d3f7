"""Raw ASGI plumbing (proxy/asgi.py): bounded body reading, whole responses, and the disconnect
watch that cancels the exchange with vLLM when the client goes away."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from tests.proxy.fakes import AsgiCall, FakeRing, FakeVLLM, settings_for
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.asgi import (
    BodyBudget,
    BodyTimeout,
    BodyTooLarge,
    BudgetExhausted,
    ClientDisconnected,
    header_value,
    read_body,
    receive_body,
    run_until_disconnect,
    send_error,
    send_response,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError

pytestmark = pytest.mark.anyio

Message = MutableMapping[str, Any]


def receiving(*messages: Message) -> Any:
    """A ``receive`` that hands out ``messages`` and then waits forever."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


def body_parts(*chunks: bytes) -> list[Message]:
    return [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]


def scope_with(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return AsgiCall.scope("POST", "/x", headers)


# ---------------------------------------------------------------------------------------------
# reading the body
# ---------------------------------------------------------------------------------------------


async def test_the_body_is_read_whole() -> None:
    receive = receiving(*body_parts(b"ab", b"", b"cd"))
    assert await read_body(scope_with([]), receive, 4) == b"abcd"
    assert await read_body(scope_with([]), receiving(*body_parts(b"one")), 3) == b"one"
    assert await read_body(scope_with([]), receiving({"type": "http.request"}), 3) == b""


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def receive() -> Message:
        raise AssertionError("read although the declared length was over the limit")

    for declared in (b"5", b"9" * 100_000):  # thousands of digits: no int() of them
        with pytest.raises(BodyTooLarge):
            await read_body(scope_with([(b"content-length", declared)]), receive, 4)


async def test_a_body_growing_over_the_limit_is_refused() -> None:
    receive = receiving(*body_parts(b"abc", b"de"))
    with pytest.raises(BodyTooLarge):
        await read_body(scope_with([(b"content-length", b"x")]), receive, 4)


async def test_a_client_leaving_mid_body() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.disconnect"}
    )
    with pytest.raises(ClientDisconnected):
        await read_body(scope_with([]), receive, 10)


async def test_receive_body_answers_413_itself_and_gives_none_for_a_gone_client() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    assert (
        await receive_body(scope_with([]), receiving(*body_parts(b"toolong")), call.send, 3) is None
    )
    assert call.status == 413
    quiet = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    gone = receiving({"type": "http.disconnect"})
    assert await receive_body(scope_with([]), gone, quiet.send, 3) is None
    assert quiet.messages == []


async def test_a_body_not_complete_in_time_is_refused_and_other_cancels_pass() -> None:
    slow = receiving({"type": "http.request", "body": b"a", "more_body": True})
    with pytest.raises(BodyTimeout):
        await read_body(scope_with([]), slow, 10, timeout=0.05)
    assert await read_body(scope_with([]), receiving(*body_parts(b"ab")), 4, timeout=5) == b"ab"
    with anyio.move_on_after(0.05) as scope:  # a cancel that is not the body's timer
        await read_body(scope_with([]), receiving(), 10, timeout=60)
    assert scope.cancelled_caught


async def test_receive_body_answers_408_and_closes() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    slow = receiving({"type": "http.request", "body": b"a", "more_body": True})
    assert await receive_body(scope_with([]), slow, call.send, 10, timeout=0.05) is None
    assert call.status == 408
    assert (b"connection", b"close") in call.messages[0]["headers"]


async def test_the_budget_is_taken_as_bytes_arrive_and_given_back() -> None:
    budget = BodyBudget(10)
    declared = scope_with([(b"content-length", b"6")])
    with budget.share() as share:
        parts = receiving(*body_parts(b"abc", b"def"))
        assert await read_body(declared, parts, 10, share) == b"abcdef"
        assert budget.held == 6
        with budget.share() as other:
            with pytest.raises(BudgetExhausted):  # declared: 6 + 5 > 10, before reading
                await read_body(scope_with([(b"content-length", b"5")]), receiving(), 10, other)
            assert budget.held == 6  # a declared length alone takes nothing
            with pytest.raises(BudgetExhausted):  # as chunks arrive
                await read_body(scope_with([]), receiving(*body_parts(b"ab", b"ccc")), 10, other)
            assert budget.held == 8
        assert budget.held == 6  # the refused one gave its part back
    assert budget.held == 0


async def test_receive_body_answers_503_over_the_budget() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    budget = BodyBudget(2)
    with budget.share() as share:
        parts = receiving(*body_parts(b"abc"))
        assert await receive_body(scope_with([]), parts, call.send, 10, share) is None
    assert call.status == 503 and budget.held == 0


def test_header_value_is_the_first_one() -> None:
    scope = scope_with([(b"x-a", b"1"), (b"x-a", b"2")])
    assert header_value(scope, b"x-a") == b"1"
    assert header_value(scope, b"x-b") is None


# ---------------------------------------------------------------------------------------------
# whole responses
# ---------------------------------------------------------------------------------------------


async def test_send_response_and_send_error() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    await send_response(call.send, 201, b"hello", b"text/plain", [(b"x-a", b"1")])
    assert call.messages == [
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", b"5"),
                (b"x-a", b"1"),
            ],
        },
        {"type": "http.response.body", "body": b"hello", "more_body": False},
    ]
    errors = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    await send_error(errors.send, ProxyError(418, "teapot", "p"))
    assert errors.status == 418
    assert errors.messages[1]["body"] == (
        b'{"error":{"message":"teapot","type":"proxy_error","param":"p","code":418}}'
    )


# ---------------------------------------------------------------------------------------------
# the disconnect watch
# ---------------------------------------------------------------------------------------------


async def test_an_exchange_that_completes_is_reported_complete() -> None:
    done: list[str] = []

    async def exchange() -> None:
        done.append("done")

    assert await run_until_disconnect(receiving(), exchange())
    assert done == ["done"]


async def test_a_disconnect_cancels_the_exchange() -> None:
    outcome: list[str] = []

    async def exchange() -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            outcome.append("cancelled")
            raise

    with anyio.fail_after(60):
        completed = await run_until_disconnect(receiving({"type": "http.disconnect"}), exchange())
    assert not completed
    assert outcome == ["cancelled"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            b'{"messages": [], "kv_transfer_params": {"return_last_hidden_state": true}}',
        ),
        ("/v1/completions", b'{"prompt": "x"}'),
        (
            "/v1/completions",
            b'{"prompt": ["a", "b"], "kv_transfer_params": {"return_last_hidden_state": true}}',
        ),
        ("/v1/embeddings", b'{"input": ["a", "b"]}'),
        ("/v1/models", b""),
    ],
    ids=["flagged", "ordinary", "prompt-list", "embeddings", "passthrough"],
)
async def test_a_client_leaving_cancels_the_pending_upstream_requests(
    path: str, body: bytes
) -> None:
    """vLLM is still generating when the client leaves: every upstream request is cancelled,
    nothing is sent to the client, no record is looked up."""
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
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await started.wait()
        return {"type": "http.disconnect"}

    async with app.router.lifespan_context(app):
        with anyio.fail_after(60):
            await app(call.scope("POST" if body else "GET", path), receive, call.send)

    assert outcome and set(outcome) == {"cancelled"}
    assert call.messages == []  # nothing sent to a client that is gone
    assert ring.lookups == 0


class EndlessStream(httpx.AsyncByteStream):
    """An SSE stream from 'vLLM' that sends one event and then waits; records how it ends."""

    def __init__(self) -> None:
        self.cancelled = False
        self.closed = anyio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            yield b"data: tick\n\n"
            await anyio.sleep_forever()
        except BaseException:  # CancelledError (task cancelled) or GeneratorExit (closed)
            self.cancelled = True
            raise

    async def aclose(self) -> None:
        self.closed.set()


async def test_a_client_leaving_mid_stream_closes_vllms_stream_under_uvicorn() -> None:
    """Streaming needs a real server: ASGITransport buffers whole bodies."""
    stream = EndlessStream()

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
        with anyio.fail_after(60):
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
    finally:
        server.should_exit = True
        with anyio.move_on_after(10):
            await serving
        serving.cancel()
        sock.close()
