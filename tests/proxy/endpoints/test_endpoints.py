"""The first stop of a chat or completions request (proxy/endpoints/__init__.py), through the app:
what the proxy answers itself before anything reaches vLLM (400, 413, 503), and what it counts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    LAYERED,
    FakeRing,
    FakeVLLM,
    error_of,
    proxy_client,
    publishing_handler,
    settings_for,
)
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, XARGS_PREFIX
from vllm_hidden_state_proxy.ring import EngineFailure, FailureNote, RingWriter

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FLAG = b'"kv_transfer_params": {"return_last_hidden_state": true}'
KEY = REQUEST_KEY_ENTRY.encode()
WIRE = b'"0123456789abcdef0123456789abcdef"'


def with_flag(**kv: object) -> bytes:
    fields = {"return_last_hidden_state": True, **kv}
    return orjson.dumps({"messages": [], "kv_transfer_params": fields})


BAD_REQUESTS = [
    # (id, path, body, param)
    ("array-body", CHAT, b"[{" + FLAG + b"}]", None),
    ("invalid-json", CHAT, b"{" + FLAG, None),
    ("invalid-utf8", CHAT, b"{" + FLAG + b', "x": "\xff\xfe"}', None),
    ("deep-nesting", CHAT, b"{" + FLAG + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (
        "flag-string",
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": "true"}}',
        "kv_transfer_params.return_last_hidden_state",
    ),
    ("stream-not-bool", CHAT, b'{"stream": 2, ' + FLAG + b"}", "stream"),
    (
        "format-unknown-unflagged",
        COMPLETIONS,
        b'{"kv_transfer_params": {"last_hidden_state_format": "b64"}}',
        "kv_transfer_params.last_hidden_state_format",
    ),
    (
        "layers-malformed",
        CHAT,
        with_flag(last_hidden_state_layers=[0, "2"]),
        "kv_transfer_params.last_hidden_state_layers",
    ),
    (
        "layers-empty",
        COMPLETIONS,
        with_flag(last_hidden_state_layers=[]),
        "kv_transfer_params.last_hidden_state_layers",
    ),
    (
        "pooling-unknown",
        CHAT,
        with_flag(last_hidden_state_pooling="max"),
        "kv_transfer_params.last_hidden_state_pooling",
    ),
    ("prompt-empty-list", COMPLETIONS, b'{"prompt": [], ' + FLAG + b"}", "prompt"),
    ("prompt-bad-item", COMPLETIONS, b'{"prompt": ["a", 3.5], ' + FLAG + b"}", "prompt"),
    ("prompt-object", COMPLETIONS, b'{"prompt": {"a": 1}, ' + FLAG + b"}", "prompt"),
    (
        "prompt-list-stream",
        COMPLETIONS,
        b'{"prompt": ["a", "b"], "stream": true, ' + FLAG + b"}",
        "stream",
    ),
    (
        "prompt-embeds-list",
        COMPLETIONS,
        b'{"prompt_embeds": ["AAAA", "AAAA"], ' + FLAG + b"}",
        "prompt_embeds",
    ),
    (
        "reserved-key-flagged",
        CHAT,
        b'{"vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}, " + FLAG + b"}",
        "vllm_xargs",
    ),
    (
        "reserved-key-unflagged",
        CHAT,
        b'{"messages": [], "vllm_xargs": {"' + KEY + b'": 1}}',
        "vllm_xargs",
    ),
    (
        "reserved-prefix",
        COMPLETIONS,
        b'{"prompt": "x", "vllm_xargs": {"' + XARGS_PREFIX.encode() + b'layers": [0]}}',
        "vllm_xargs",
    ),
    (
        "reserved-escaped",
        CHAT,
        b'{"vllm_xargs": {"hidden_state_proxy\\u005fpooling": "mean"}}',
        "vllm_xargs",
    ),
    (
        "reserved-utf16",
        COMPLETIONS,
        ('{"prompt": "x", "vllm_xargs": {"' + REQUEST_KEY_ENTRY + '": "00"}}').encode("utf-16"),
        "vllm_xargs",
    ),
    (
        "reserved-lone-surrogate",
        COMPLETIONS,
        b'{"prompt": "\\ud800", "vllm_xargs": {"' + KEY + b'": ' + WIRE + b"}}",
        "vllm_xargs",
    ),
    ("beam-search", CHAT, b'{"use_beam_search": true, ' + FLAG + b"}", "use_beam_search"),
    (
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
async def test_bad_requests_are_400_in_openai_shape_and_reach_nobody(
    path: str, body: bytes, param: str | None
) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), vllm, ring) as proxy:
        response = await proxy.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert vllm.requests == []
    assert ring.lookups == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_body_over_the_limit_is_413(chunked: bool, path: str) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    payload = b'{"messages": "' + b"x" * 2000 + b'"}'

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    settings = settings_for("/unused", max_body_bytes=1024)
    async with proxy_client(settings, vllm, FakeRing()) as proxy:
        response = await proxy.client.post(path, content=pieces() if chunked else payload)
        small = await proxy.client.post(path, content=payload[:1000] + b'"}')
    assert response.status_code == 413
    assert "1024 bytes" in error_of(response)["message"]
    assert small.status_code == 200  # just under the limit still goes through
    assert len(vllm.requests) == 1


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_no_ring_is_503_before_forwarding_and_ordinary_traffic_flows(
    ring_dir: str, path: str
) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:  # a real, empty directory
        flagged = await proxy.client.post(
            path, json={"prompt": "x", "kv_transfer_params": {"return_last_hidden_state": True}}
        )
        ordinary = await proxy.client.post(path, json={"prompt": "x"})
        assert proxy.metrics.flagged_received == 1
        assert proxy.metrics.requests == {"ordinary": 1, "flagged": 0, "embeddings": 0}
    assert flagged.status_code == 503
    error = error_of(flagged)
    assert error["type"] == "service_unavailable"
    assert ring_dir in error["message"]
    assert "hidden_state_hook" in error["message"]
    assert "vllm.general_plugins" in error["message"]
    assert ordinary.status_code == 200
    (forwarded,) = vllm.requests
    assert "vllm_xargs" not in orjson.loads(forwarded.content)


async def test_no_ring_but_a_failure_note_is_503_naming_the_engine(ring_dir: str) -> None:
    note = FailureNote.write(ring_dir, instance=0xF00D, engine=2, message="out of shared memory")
    vllm = FakeVLLM(publishing_handler(None))
    try:
        async with proxy_client(settings_for(ring_dir), vllm) as proxy:
            response = await proxy.client.post(CHAT, content=b"{" + FLAG + b"}")
    finally:
        note.close()
    assert response.status_code == 503
    message = error_of(response)["message"]
    assert "engine 2" in message and "000000000000f00d" in message
    assert "out of shared memory" in message
    assert vllm.requests == []


async def test_a_fake_ring_with_failures_and_no_live_ring_is_503() -> None:
    ring = FakeRing(present=False, failures=(EngineFailure(1, 3, 99, "hook disabled"),))
    vllm = FakeVLLM(publishing_handler(None))
    async with proxy_client(settings_for("/unused"), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, content=b"{" + FLAG + b"}")
    assert response.status_code == 503
    assert "engine 3" in error_of(response)["message"]
    assert vllm.requests == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_layer_the_server_does_not_capture_is_400_listing_the_captured(
    ring_dir: str, layered_writer: RingWriter, path: str
) -> None:
    vllm = FakeVLLM(publishing_handler(layered_writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(path, content=with_flag(last_hidden_state_layers=[0, 3]))
        assert proxy.metrics.flagged_received == 1
        assert proxy.metrics.requests["flagged"] == 0
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "kv_transfer_params.last_hidden_state_layers"
    assert "Layer 3 is not captured" in error["message"]
    assert (
        f"captures layers {', '.join(map(str, LAYERED))} (the model has {FINAL} decoder layers"
        in error["message"]
    )
    assert vllm.requests == []


async def test_a_plain_server_captures_only_the_final_layer(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        refused = await proxy.client.post(CHAT, content=with_flag(last_hidden_state_layers=[0]))
        accepted = await proxy.client.post(
            CHAT, content=with_flag(last_hidden_state_layers=[-1, FINAL])
        )
    assert refused.status_code == 400
    assert (
        f"captures layers {FINAL} (the model has {FINAL} decoder layers"
        in error_of(refused)["message"]
    )
    assert accepted.status_code == 200, accepted.text


async def test_what_the_endpoints_count() -> None:
    vllm = FakeVLLM(publishing_handler(FakeRing()))
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        await proxy.client.post(CHAT, json={"messages": []})
        # A body inspection refuses is not counted (it may not even be flagged) ...
        await proxy.client.post(CHAT, content=b'{"stream": 2, ' + FLAG + b"}")
        await proxy.client.post(COMPLETIONS, content=b"{" + FLAG + b', "prompt": "x"}')
        assert proxy.metrics.requests == {"ordinary": 1, "flagged": 1, "embeddings": 0}
        assert proxy.metrics.flagged_received == 1
        # ... a flagged one refused for the rings' sake is.
        await proxy.client.post(CHAT, content=with_flag(last_hidden_state_layers=[1]))
        assert proxy.metrics.flagged_received == 2
        assert proxy.metrics.requests["flagged"] == 1
