"""Small pieces in isolation: flag helpers, settings, vector wait, broken upstream streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.proxy import ProxySettings, create_app
from vllm_hidden_state_proxy.proxy.flag import (
    Flagged,
    Forward,
    flagged_request_body,
    inspect_body,
    needs_inspection,
    with_kv_fields,
)
from vllm_hidden_state_proxy.proxy.vectors import wait_for_vector

from tests.proxy.fakes import AsgiCall, FakeRecord, FakeRing, FakeVLLM, proxy_client, settings_for


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"messages": [{"role": "user", "content": "hello"}]}', False),
        (b'{"kv_transfer_params": {"return_last_hidden_state": true}}', True),
        (b'{"vllm_xargs": {"' + REQUEST_KEY_ENTRY.encode() + b'": "x"}}', True),
        (b'{"content": "caf\\u00e9"}', True),  # any escape may hide a name: inspect
        ('{"content": "café"}'.encode(), False),
    ],
)
def test_needs_inspection(body: bytes, expected: bool) -> None:
    assert needs_inspection(body) is expected


def test_unflagged_body_with_marker_is_forwarded_as_is() -> None:
    body = b'{"messages": [], "kv_transfer_params": {"x": "return_last_hidden_state"}}'
    assert inspect_body(body) == Forward(body)


def test_flagged_document_is_stripped() -> None:
    decision = inspect_body(
        b'{"n": 1, "stream": false, "kv_transfer_params": {"return_last_hidden_state": true}}'
    )
    assert decision == Flagged({"n": 1, "stream": False})


def test_flagged_request_body_merges_xargs() -> None:
    document = {"messages": [], "vllm_xargs": {"a": 1}}
    sent = orjson.loads(flagged_request_body(document, "ab" * 16))
    assert sent == {"messages": [], "vllm_xargs": {"a": 1, REQUEST_KEY_ENTRY: "ab" * 16}}
    assert document == {"messages": [], "vllm_xargs": {"a": 1}}  # input not mutated


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (None, {"last_hidden_state": [1.5]}),
        ("junk", {"last_hidden_state": [1.5]}),
        ({"a": 1}, {"a": 1, "last_hidden_state": [1.5]}),
        ({"last_hidden_state": "stale"}, {"last_hidden_state": [1.5]}),
    ],
)
def test_with_kv_fields(kv: Any, expected: dict[str, Any]) -> None:
    out = with_kv_fields({"id": "x", "kv_transfer_params": kv}, {"last_hidden_state": [1.5]})
    assert out == {"id": "x", "kv_transfer_params": expected}


@pytest.mark.parametrize(
    "overrides",
    [
        {"upstream_url": "vllm:8000"},
        {"max_body_bytes": 0},
        {"vector_timeout": -1.0},
        {"request_timeout": 0.0},
        {"health_timeout": 0.0},
    ],
)
def test_settings_validation(overrides: dict[str, Any]) -> None:
    values: dict[str, Any] = {"upstream_url": "http://vllm:8000", "ring_dir": "/x"}
    values.update(overrides)
    with pytest.raises(ValueError):
        ProxySettings(**values)


def test_settings_defaults() -> None:
    settings = ProxySettings(upstream_url="http://vllm:8000/")
    assert settings.upstream_base == "http://vllm:8000"
    assert settings.vector_timeout == 5.0
    assert settings.max_body_bytes == 32 * 1024 * 1024
    assert settings.max_connections == 1000
    assert settings.request_timeout is None
    assert settings.api_key is None


class CountdownRing(FakeRing):
    """Publishes after ``remaining`` lookups."""

    def __init__(self, remaining: int) -> None:
        super().__init__()
        self.remaining = remaining

    def lookup(self, key: bytes) -> FakeRecord | None:
        self.lookups += 1
        self.remaining -= 1
        return FakeRecord(key, [2.0]) if self.remaining <= 0 else None


@pytest.mark.anyio
async def test_wait_for_vector_backs_off_and_finds_late_record() -> None:
    ring = CountdownRing(6)
    started = time.monotonic()
    record, waited, _ = await wait_for_vector(ring, b"k" * 16, timeout=2.0)
    assert record is not None and record.as_floats() == [2.0]
    assert ring.lookups == 6
    assert 0 < waited < 0.5
    assert time.monotonic() - started < 0.5


@pytest.mark.anyio
async def test_wait_for_vector_fast_path_and_timeout() -> None:
    hit = CountdownRing(1)
    assert await wait_for_vector(hit, b"k" * 16, timeout=1.0) == (
        FakeRecord(b"k" * 16, [2.0]),
        0.0,
        False,
    )
    miss = CountdownRing(10**9)
    record, waited, overwritten = await wait_for_vector(miss, b"k" * 16, timeout=0.03)
    assert record is None and not overwritten
    assert 0.03 <= waited < 0.5
    assert 3 <= miss.lookups < 200  # polls, but with backoff rather than a busy loop


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("upstream", "expected"),
    [
        ("http://vllm.test:8000/", b"http://vllm.test:8000/v1/models?a=1"),
        ("http://vllm.test:8000/base", b"http://vllm.test:8000/base/v1/models?a=1"),
    ],
)
async def test_upstream_url_joining(upstream: str, expected: bytes) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=str(request.url).encode())

    settings = settings_for("/unused", upstream_url=upstream)
    async with proxy_client(settings, FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.get("/v1/models?a=1")
    assert response.content == expected


@pytest.mark.anyio
async def test_upstream_breaking_mid_stream_cuts_the_response() -> None:
    """Headers are out: the response must end incomplete, never look complete."""

    async def produce() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise httpx.ReadError("vLLM died")

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=FakeRing())
    call = AsgiCall(app)
    pending = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> MutableMapping[str, Any]:
        if pending:
            return pending.pop()
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: MutableMapping[str, Any]) -> None:
        call.messages.append(message)

    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await app(call.scope("POST", "/v1/completions", []), receive, send)
        assert app.state.proxy.metrics.upstream_errors == 1
    assert call.status == 200
    assert call.body_chunks == [b"data: 1\n\n"]
    assert all(m.get("more_body", True) for m in call.messages[1:])  # never completed


def test_upstream_requests_carry_the_settings_timeouts() -> None:
    """The transport is called without an AsyncClient: the timeouts must ride on the request."""
    from vllm_hidden_state_proxy.proxy.upstream import build_request

    settings = ProxySettings(
        upstream_url="http://vllm:8000", ring_dir="/x", request_timeout=0.5, connect_timeout=2.0
    )
    scope = {"method": "POST", "path": "/v1/models", "headers": [], "query_string": b""}
    request = build_request(settings, scope, b"{}")
    assert request.extensions["timeout"] == {
        "connect": 2.0,
        "read": 0.5,
        "write": 0.5,
        "pool": None,
    }


@pytest.mark.anyio
async def test_a_vllm_that_never_answers_is_a_504_after_the_read_timeout() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        timeout = request.extensions["timeout"]["read"]
        await anyio.sleep(timeout)  # what httpcore does with the extension: give up after it
        raise httpx.ReadTimeout("timed out", request=request)

    settings = settings_for("/unused", request_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(hang), FakeRing()) as proxy:
        response = await proxy.client.get("/v1/models")
    assert response.status_code == 504
