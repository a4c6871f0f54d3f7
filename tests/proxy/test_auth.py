"""The optional proxy API key: Bearer token, constant-time check, 401 in OpenAI shape."""

from __future__ import annotations

import httpx
import pytest

from vllm_hidden_state_proxy.proxy.auth import ApiKeyGuard

from tests.proxy.fakes import FakeRing, FakeVLLM, error_of, proxy_client, settings_for

pytestmark = pytest.mark.anyio

KEY = "s3cret-key"


async def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"path": request.url.path})


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": "Basic x"}],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
async def test_missing_or_wrong_key_is_401_and_nothing_reaches_vllm(
    headers: dict[str, str],
) -> None:
    vllm = FakeVLLM(ok)
    async with proxy_client(settings_for("/unused", api_key=KEY), vllm, FakeRing()) as proxy:
        for path in ("/v1/chat/completions", "/v1/models", "/v1/embeddings", "/tokenize"):
            response = await proxy.client.post(path, json={}, headers=headers)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert error_of(response)["type"] == "authentication_error"
    assert vllm.requests == []


async def test_right_key_passes_and_is_forwarded_for_vllms_own_key() -> None:
    vllm = FakeVLLM(ok)
    async with proxy_client(settings_for("/unused", api_key=KEY), vllm, FakeRing()) as proxy:
        response = await proxy.client.get("/v1/models", headers={"authorization": f"bearer {KEY}"})
    assert response.status_code == 200
    assert vllm.requests[0].headers["authorization"] == f"bearer {KEY}"


async def test_upstream_key_replaces_the_clients_header() -> None:
    vllm = FakeVLLM(ok)
    settings = settings_for("/unused", api_key=KEY, upstream_api_key="vllm-key")
    async with proxy_client(settings, vllm, FakeRing()) as proxy:
        await proxy.client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert vllm.requests[0].headers.get_list("authorization") == ["Bearer vllm-key"]


async def test_health_is_open_metrics_open_unless_protected() -> None:
    async def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"")

    for protect, metrics_status in ((False, 200), (True, 401)):
        settings = settings_for("/unused", api_key=KEY, protect_metrics=protect)
        async with proxy_client(settings, FakeVLLM(health), FakeRing()) as proxy:
            assert (await proxy.client.get("/health")).status_code == 200
            assert (await proxy.client.get("/metrics")).status_code == metrics_status
            authorised = await proxy.client.get(
                "/metrics", headers={"authorization": f"Bearer {KEY}"}
            )
            assert authorised.status_code == 200


async def test_no_key_configured_means_no_check() -> None:
    vllm = FakeVLLM(ok)
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        assert (await proxy.client.get("/v1/models")).status_code == 200


def test_the_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard compares with hmac.compare_digest (not ==)."""
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    guard = ApiKeyGuard(lambda s, r, se: None, api_key=KEY)  # type: ignore[arg-type,return-value]
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer x")]}
    import anyio

    anyio.run(guard, scope, None, send)  # type: ignore[arg-type]
    assert calls == [(b"x", KEY.encode())]
    assert sent[0]["status"] == 401
