"""Requests the proxy answers itself: 400 (invalid/unsupported), 413 (too big), 502 (no vLLM)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    error_of,
    proxy_client,
    publishing_handler,
    settings_for,
)

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
FLAG = b'"kv_transfer_params": {"return_last_hidden_state": true}'
KEY = REQUEST_KEY_ENTRY.encode()
WIRE = b'"0123456789abcdef0123456789abcdef"'

BAD_REQUESTS = [
    # (id, path, body, param)
    ("array-body", CHAT, b"[{" + FLAG + b"}]", None),
    ("string-body", CHAT, b'"return_last_hidden_state"', None),
    ("invalid-json", CHAT, b"{" + FLAG, None),
    ("invalid-utf8", CHAT, b"{" + FLAG + b', "x": "\xff\xfe"}', None),
    ("deep-nesting", CHAT, b"{" + FLAG + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (
        "flag-int",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": 1}}',
        "kv_transfer_params.return_last_hidden_state",
    ),
    (
        "flag-string",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": "true"}}',
        "kv_transfer_params.return_last_hidden_state",
    ),
    (
        "flag-null",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": null}}',
        "kv_transfer_params.return_last_hidden_state",
    ),
    (
        "kv-not-object",
        CHAT,
        b'{"kv_transfer_params": ["return_last_hidden_state"]}',
        "kv_transfer_params",
    ),
    ("stream-not-bool", CHAT, b'{"stream": 1, ' + FLAG + b"}", "stream"),
    (
        "format-not-string",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": true, '
        b'"last_hidden_state_format": 1}}',
        "kv_transfer_params.last_hidden_state_format",
    ),
    (
        "format-unknown",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": true, '
        b'"last_hidden_state_format": "float16"}}',
        "kv_transfer_params.last_hidden_state_format",
    ),
    (
        # Checked even when the flag is off: a typo should not pass silently.
        "format-unknown-unflagged",
        "/v1/completions",
        b'{"kv_transfer_params": {"last_hidden_state_format": "b64"}}',
        "kv_transfer_params.last_hidden_state_format",
    ),
    (
        "info-not-bool",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": true, '
        b'"last_hidden_state_info": "yes"}}',
        "kv_transfer_params.last_hidden_state_info",
    ),
    ("prompt-empty-list", "/v1/completions", b'{"prompt": [], ' + FLAG + b"}", "prompt"),
    ("prompt-bad-item", "/v1/completions", b'{"prompt": ["a", 3.5], ' + FLAG + b"}", "prompt"),
    ("prompt-empty-ids", "/v1/completions", b'{"prompt": ["a", []], ' + FLAG + b"}", "prompt"),
    ("prompt-object", "/v1/completions", b'{"prompt": {"a": 1}, ' + FLAG + b"}", "prompt"),
    (
        "prompt-list-stream",
        "/v1/completions",
        b'{"prompt": ["a", "b"], "stream": true, ' + FLAG + b"}",
        "stream",
    ),
    (
        "prompt-embeds-list",
        "/v1/completions",
        b'{"prompt_embeds": ["AAAA", "AAAA"], ' + FLAG + b"}",
        "prompt_embeds",
    ),
    (
        "internal-key-flagged",
        CHAT,
        b'{"vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}, " + FLAG + b"}",
        "vllm_xargs",
    ),
    (
        "internal-key-unflagged",
        CHAT,
        b'{"messages": [], "vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}}",
        "vllm_xargs",
    ),
    (
        # JSON escapes spell the reserved key; a substring search alone would miss it.
        "internal-key-escaped",
        CHAT,
        b'{"vllm_xargs": {"hidden_state_proxy\\u005fkey": ' + WIRE + b"}}",
        "vllm_xargs",
    ),
    (
        "internal-key-completions",
        "/v1/completions",
        b'{"prompt": "x", "vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}}",
        "vllm_xargs",
    ),
    (
        # Endpoints without vector support refuse the flag rather than a 200 without vector.
        "flag-on-responses",
        "/v1/responses",
        b'{"input": "x", ' + FLAG + b"}",
        "kv_transfer_params.return_last_hidden_state",
    ),
    (
        "beam-search",
        CHAT,
        b'{"use_beam_search": true, ' + FLAG + b"}",
        "use_beam_search",
    ),
    (
        # UTF-16 JSON (vLLM accepts it): the reserved key cannot hide from a byte search.
        "internal-key-utf16",
        "/v1/completions",
        ('{"prompt": "x", "vllm_xargs": {"' + REQUEST_KEY_ENTRY + '": "00"}}').encode("utf-16"),
        "vllm_xargs",
    ),
    (
        # Only Python's json accepts this body (lone surrogate); vLLM would use the key.
        "internal-key-lone-surrogate",
        "/v1/completions",
        b'{"prompt": "\\ud800", "vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}}",
        "vllm_xargs",
    ),
    ("xargs-not-object", CHAT, b'{"vllm_xargs": [1], ' + FLAG + b"}", "vllm_xargs"),
    (
        # Escaped flag name: still recognised as flagged (and then refused for beam search).
        "escaped-flag-beam-search",
        CHAT,
        b'{"use_beam_search": true, '
        b'"kv_transfer_params": {"return_last_hidden_stat\\u0065": true}}',
        "use_beam_search",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_request_is_400_in_openai_shape(
    path: str, body: bytes, param: str | None
) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert vllm.requests == []


async def test_reserved_key_message_says_it_is_reserved() -> None:
    body = b'{"vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}}"
    async with proxy_client(settings_for("/unused"), FakeVLLM(publishing_handler(None))) as proxy:
        response = await proxy.client.post(CHAT, content=body)
    assert "reserved" in error_of(response)["message"]


async def test_unparseable_body_on_other_paths_is_left_to_vllm() -> None:
    """Outside the generation paths the proxy only guards its reserved key; vLLM judges the
    rest."""

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, content=b"vllm says no")

    vllm = FakeVLLM(handle)
    body = b'{"vllm_xargs": {"' + KEY + b'": [}'
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post("/v1/responses", content=body)
    assert (response.status_code, response.content) == (422, b"vllm says no")
    assert vllm.requests[0].content == body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_body_too_large_is_413(chunked: bool, path: str) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    payload = b'{"messages": "' + b"x" * 2000 + b'"}'

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    async with proxy_client(settings_for("/unused", max_body_bytes=1024), vllm, FakeRing()) as p:
        content = pieces() if chunked else payload
        response = await p.client.post(path, content=content)
        small = await p.client.post(path, content=payload[:1000] + b'"}')
    assert response.status_code == 413
    error = error_of(response)
    assert "1024" in error["message"]
    assert small.status_code == 200  # just under the limit still goes through
    assert len(vllm.requests) == 1


async def test_upstream_connect_error_is_502() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        ordinary = await proxy.client.get("/v1/models")
        flagged = await proxy.client.post(CHAT, content=b"{" + FLAG + b', "messages": []}')
        assert proxy.metrics.upstream_errors == 2
    for response in (ordinary, flagged):
        assert response.status_code == 502
        error = error_of(response)
        assert error["type"] == "bad_gateway"
        assert "http://vllm.test:8000" in error["message"]
    assert ring.lookups == 0


async def test_upstream_read_timeout_is_504() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.get("/v1/models")
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


async def test_nothing_listening_is_502() -> None:
    """A real connection attempt (no mock transport) to a closed loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = settings_for("/unused", upstream_url=f"http://127.0.0.1:{port}")
    async with proxy_client(settings, None, FakeRing()) as proxy:
        response = await proxy.client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 502
    assert f"http://127.0.0.1:{port}" in error_of(response)["message"]
