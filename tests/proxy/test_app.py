"""Assembling the proxy (proxy/app.py): routes, the lifespan that opens the connections and the
rings, the API-key middleware only when there is a key."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    create_writer,
    error_of,
    proxy_client,
    publishing_handler,
    running,
    settings_for,
)
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.auth import ApiKeyGuard
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.ring import RingDirectory, RingWriter
from vllm_hidden_state_proxy.transport.ops import OpsClient

pytestmark = pytest.mark.anyio

FLAGGED = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "kv_transfer_params": {"return_last_hidden_state": True},
}


async def test_the_lifespan_opens_and_closes_its_own_ring_directory(ring_dir: str) -> None:
    app = create_app(settings_for(ring_dir), FakeVLLM(publishing_handler(None)).transport)
    state: ProxyState = app.state.proxy
    assert state.connections is None
    async with running(app):
        rings = state.rings
        assert isinstance(rings, RingDirectory)
        assert str(rings.directory) == ring_dir
        assert isinstance(state.ops_client, OpsClient)
        assert isinstance(state.transport, httpx.MockTransport)
    assert state.connections is None
    assert rings.lookup(bytes(range(16))) is None and not rings.has_ring()  # closed


async def test_a_ring_passed_in_is_used_and_left_open() -> None:
    ring = FakeRing()
    app = create_app(
        settings_for("/unused"), FakeVLLM(publishing_handler(ring)).transport, ring=ring
    )
    async with running(app) as client:
        assert app.state.proxy.rings is ring
        assert (await client.post("/v1/chat/completions", json=FLAGGED)).status_code == 200
    assert not ring.closed


def test_the_api_key_guard_is_there_only_with_a_key() -> None:
    transport = FakeVLLM(publishing_handler(None)).transport
    plain = create_app(settings_for("/unused"), transport)
    guarded = create_app(settings_for("/unused", api_key="k"), transport)
    plain_classes: list[object] = [m.cls for m in plain.user_middleware]
    guarded_classes: list[object] = [m.cls for m in guarded.user_middleware]
    assert ApiKeyGuard not in plain_classes
    assert guarded_classes == [ApiKeyGuard]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/health", 200),
        ("GET", "/metrics", 200),
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/completions", 200),
        ("POST", "/v1/embeddings", 200),
        ("DELETE", "/v1/files/x", 201),  # anything else: passed through
        ("GET", "/v1/chat/completions", 201),  # another method on a special path too
    ],
)
async def test_routes(method: str, path: str, status: int) -> None:
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        special = (request.method, request.url.path) in {
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
        }
        if b"hidden_state_proxy_key" in request.content:
            return await publishing_handler(ring)(request)
        return httpx.Response(200 if special else 201, json={"id": "x", "choices": []})

    body = {"input": "x"} if path.endswith("embeddings") else {"prompt": "x"}
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.request(method, path, json=body if method == "POST" else None)
    assert response.status_code == status, response.text


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
async def test_a_ring_owned_by_an_untrusted_user_is_refused(
    ring_dir: str, writer: RingWriter
) -> None:
    """The lifespan's directory trusts the settings' owners: by default its own user and root."""
    os.chown(writer.path, 4242, -1)
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        refused = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
    assert refused.status_code == 503
    assert "not active" in error_of(refused)["message"]
    assert vllm.requests == []
    trusting = settings_for(ring_dir, ring_owner_uids=(4242,))
    async with proxy_client(trusting, FakeVLLM(publishing_handler(writer))) as proxy:
        accepted = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
    assert accepted.status_code == 200, accepted.text


async def test_a_world_writable_ring_directory_is_refused_naming_why(
    ring_dir: str, writer: RingWriter
) -> None:
    """Any local user could replace the rings there: the proxy reads none of them, and a
    flagged request's 503 says why; once the directory is fixed, its rings are read again."""
    os.chmod(ring_dir, 0o777)
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        refused = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
        assert refused.status_code == 503
        message = error_of(refused)["message"]
        assert f"the ring directory {ring_dir} (mode 0o777) is writable by every user" in message
        assert vllm.requests == []
        os.chmod(ring_dir, 0o700)
        accepted = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
    assert accepted.status_code == 200, accepted.text


async def test_rings_of_every_engine_in_the_directory_are_read(ring_dir: str) -> None:
    with create_writer(ring_dir, engine=0) as first, create_writer(ring_dir, engine=1) as second:
        hooks = [first, second]
        served: list[int] = []

        async def handle(request: httpx.Request) -> httpx.Response:
            engine = len(served) % 2  # vLLM's load balancer: round robin
            served.append(engine)
            return await publishing_handler(hooks[engine])(request)

        async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
            responses = [
                await proxy.client.post("/v1/chat/completions", json=FLAGGED) for _ in range(4)
            ]
    assert [r.status_code for r in responses] == [200] * 4
    assert served == [0, 1, 0, 1]
