"""Flagged chat requests: key injected, vector joined in, never a 200 without the vector."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import (
    FakeRecord,
    FakeRing,
    FakeVLLM,
    completion,
    error_of,
    forwarded_key,
    proxy_client,
    publishing_handler,
    settings_for,
    vector_bytes,
    vector_for,
)

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def flagged(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "kv_transfer_params": {"return_last_hidden_state": True},
    }
    body.update(extra)
    return body


async def test_flagged_happy_path_joins_this_requests_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(publishing_handler(writer, response_kv={"remote_engine_id": "e1"}))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(
            CHAT,
            json=flagged(max_tokens=1, vllm_xargs={"mine": 7}),
            headers={"x-request-id": "r1"},
        )
        metrics = proxy.metrics
        assert metrics.requests == {"ordinary": 0, "flagged": 1, "embeddings": 0}
        assert metrics.flagged_received == 1
        assert metrics.vector_wait.count == 1

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    (forwarded,) = vllm.requests
    key = forwarded_key(forwarded)
    body = response.json()
    assert body["kv_transfer_params"] == {
        "remote_engine_id": "e1",
        "last_hidden_state": vector_for(key),
    }
    assert body["choices"] == completion()["choices"]
    assert int(response.headers["content-length"]) == len(response.content)

    sent = orjson.loads(forwarded.content)
    assert "kv_transfer_params" not in sent  # emptied by stripping the flag: dropped
    assert sent["messages"] == MESSAGES
    assert sent["max_tokens"] == 1
    assert sent["model"] == "m"
    assert set(sent["vllm_xargs"]) == {"mine", REQUEST_KEY_ENTRY}
    assert sent["vllm_xargs"]["mine"] == 7
    wire = sent["vllm_xargs"][REQUEST_KEY_ENTRY]
    assert len(wire) == 32 and all(c in "0123456789abcdef" for c in wire)
    assert forwarded.headers["content-length"] == str(len(forwarded.content))
    assert forwarded.headers["x-request-id"] == "r1"
    assert forwarded.url.path == CHAT


async def test_each_request_gets_its_own_key_and_vector(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        responses = await asyncio.gather(
            *(proxy.client.post(CHAT, json=flagged()) for _ in range(5))
        )
    keys = {forwarded_key(r) for r in vllm.requests}
    assert len(keys) == 5
    vectors = [r.json()["kv_transfer_params"]["last_hidden_state"] for r in responses]
    assert sorted(map(tuple, vectors)) == sorted(tuple(vector_for(k)) for k in keys)


async def test_other_kv_transfer_params_kept_in_forwarded_request(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(publishing_handler(writer))
    body = flagged()
    body["kv_transfer_params"]["do_remote_prefill"] = False
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200
    sent = orjson.loads(vllm.requests[0].content)
    assert sent["kv_transfer_params"] == {"do_remote_prefill": False}
    assert response.json()["kv_transfer_params"]["last_hidden_state"] == vector_for(
        forwarded_key(vllm.requests[0])
    )


@pytest.mark.parametrize(
    ("kv", "expected_kv"),
    [
        ({"return_last_hidden_state": False}, None),
        ({"return_last_hidden_state": False, "other": 1}, {"other": 1}),
    ],
)
async def test_flag_false_is_stripped_and_forwarded_as_ordinary(
    kv: dict[str, Any], expected_kv: dict[str, Any] | None
) -> None:
    upstream_body = orjson.dumps(completion())

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=upstream_body)

    vllm = FakeVLLM(handle)
    ring = FakeRing(present=False)
    async with proxy_client(settings_for("/unused"), vllm, ring) as proxy:
        response = await proxy.client.post(
            CHAT, json={"messages": MESSAGES, "kv_transfer_params": kv, "vllm_xargs": {"a": "b"}}
        )
        assert proxy.metrics.requests == {"ordinary": 1, "flagged": 0, "embeddings": 0}
    assert response.status_code == 200
    assert response.content == upstream_body
    sent = orjson.loads(vllm.requests[0].content)
    assert sent.get("kv_transfer_params") == expected_kv
    assert sent["vllm_xargs"] == {"a": "b"}
    assert sent["messages"] == MESSAGES
    assert ring.lookups == 0


async def test_vector_published_after_a_delay_is_awaited(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        loop = asyncio.get_running_loop()
        loop.call_later(
            0.02,
            lambda: writer.publish(
                key, vector_bytes(vector_for(key)), position=4, num_prompt_tokens=5
            ),
        )
        return httpx.Response(200, json=completion())

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for(ring_dir, vector_timeout=2.0), vllm) as proxy:
        started = time.monotonic()
        response = await proxy.client.post(CHAT, json=flagged())
        elapsed = time.monotonic() - started
        wait = proxy.metrics.vector_wait
    assert response.status_code == 200
    key = forwarded_key(vllm.requests[0])
    assert response.json()["kv_transfer_params"]["last_hidden_state"] == vector_for(key)
    assert 0.015 <= elapsed < 1.0
    assert wait.count == 1 and 0.01 <= wait.total < 1.0


async def test_vector_never_published_is_504(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(publishing_handler(None))  # vLLM answers, nobody publishes
    async with proxy_client(settings_for(ring_dir, vector_timeout=0.05), vllm) as proxy:
        started = time.monotonic()
        response = await proxy.client.post(CHAT, json=flagged())
        elapsed = time.monotonic() - started
        assert proxy.metrics.vector_misses == {"overwritten": 0, "not_published": 1}
        assert proxy.metrics.vector_wait.count == 0
    assert response.status_code == 504
    error = error_of(response)
    assert error["type"] == "gateway_timeout"
    assert "0.05 s" in error["message"]
    assert "not published by the vLLM worker hook" in error["message"]
    assert 0.05 <= elapsed < 1.0


async def test_record_for_another_key_is_never_returned() -> None:
    vllm = FakeVLLM(publishing_handler(None))
    ring = FakeRing(wrong_key=True)
    async with proxy_client(settings_for("/unused", vector_timeout=0.03), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 504
    assert ring.lookups >= 2  # fast path plus at least one backoff poll


async def test_fake_ring_record_is_used() -> None:
    """The ring seam: create_app(ring=...) is what the proxy consults."""
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        ring.records[key] = FakeRecord(key, [0.5, -1.25])
        return httpx.Response(200, json=completion(kv={"x": 1}))

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.json()["kv_transfer_params"] == {"x": 1, "last_hidden_state": [0.5, -1.25]}


@pytest.mark.parametrize("status", [400, 404, 500])
async def test_upstream_error_passes_through_unchanged_without_lookup(status: int) -> None:
    upstream_body = (
        b'{"error":{"message":"bad model","type":"BadRequestError","param":null,"code":400}}'
    )

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status,
            headers={"content-type": "application/json; charset=utf-8", "x-vllm": "1"},
            content=upstream_body,
        )

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == status
    assert response.content == upstream_body
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert response.headers["x-vllm"] == "1"
    assert ring.lookups == 0


async def test_upstream_200_that_is_not_json_is_502() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: {}\n\n")

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 502
    assert error_of(response)["type"] == "bad_gateway"
    assert ring.lookups == 0


async def test_no_ring_is_503_before_forwarding(ring_dir: str) -> None:
    vllm = FakeVLLM(publishing_handler(None))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:  # real, empty RingDirectory
        response = await proxy.client.post(CHAT, json=flagged())
        ordinary = await proxy.client.post(CHAT, json={"messages": MESSAGES})
    assert response.status_code == 503
    error = error_of(response)
    assert error["type"] == "service_unavailable"
    assert ring_dir in error["message"]
    assert "hidden_state_hook" in error["message"]
    assert "vllm.general_plugins" in error["message"]
    assert ordinary.status_code == 200  # unflagged traffic is unaffected
    assert len(vllm.requests) == 1
    assert "vllm_xargs" not in orjson.loads(vllm.requests[0].content)


async def test_upstream_200_breaking_mid_body_is_502_not_200() -> None:
    async def produce() -> AsyncIterator[bytes]:
        yield b'{"id": "x", "choices": ['
        raise httpx.ReadError("connection reset")

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=produce())

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
        assert proxy.metrics.upstream_errors == 1
    assert response.status_code == 502
    assert "connection reset" in error_of(response)["message"]
    assert ring.lookups == 0


async def test_a_utf16_flagged_body_is_recognised_and_gets_its_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    """vLLM's parser accepts UTF-16 JSON, so a byte search for the flag alone would miss it."""
    vllm = FakeVLLM(publishing_handler(writer))
    body = orjson.dumps(flagged()).decode().encode("utf-16")
    assert b"return_last_hidden_state" not in body
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, content=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    assert response.json()["kv_transfer_params"]["last_hidden_state"] == vector_for(
        forwarded_key(forwarded)
    )


async def test_a_body_only_pythons_json_accepts_still_works_flagged(
    ring_dir: str, writer: RingWriter
) -> None:
    """A lone surrogate escape: orjson refuses it, vLLM (Python's json) accepts it."""
    vllm = FakeVLLM(publishing_handler(writer))
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}],'
        b' "kv_transfer_params": {"return_last_hidden_state": true}}'
    )
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, content=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    assert b"\\ud800" in forwarded.content
    assert "last_hidden_state" in response.json()["kv_transfer_params"]


async def test_a_vector_overwritten_before_the_response_is_a_clear_504_at_once(
    ring_dir: str, writer: RingWriter
) -> None:
    """The ring reused the slot (more flagged prefills than slots meanwhile): never a wrong
    vector, no pointless wait, and a message that says what to change."""
    publish_ours = publishing_handler(writer)

    async def handle(request: httpx.Request) -> httpx.Response:
        response = await publish_ours(request)
        for i in range(writer.slot_count):  # other requests' prefills fill every slot
            other = bytes([i + 1]) * 16
            writer.publish(other, vector_bytes(vector_for(other)), position=0, num_prompt_tokens=1)
        return response

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for(ring_dir, vector_timeout=5.0), vllm) as proxy:
        started = time.monotonic()
        response = await proxy.client.post(CHAT, json=flagged())
        elapsed = time.monotonic() - started
        assert proxy.metrics.vector_misses == {"overwritten": 1, "not_published": 0}
    assert response.status_code == 504
    message = error_of(response)["message"]
    assert "overwritten" in message and "HIDDEN_STATE_PROXY_RING_SLOTS" in message
    assert f"{writer.slot_count} slots" in message
    assert elapsed < 1.0  # not the 5 s vector timeout
