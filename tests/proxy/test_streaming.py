"""Flagged streams: the vector rides on the first choice chunk, every other byte unchanged."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    error_of,
    forwarded_key,
    proxy_client,
    settings_for,
    vector_bytes,
    vector_for,
)

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def chunk(index: int, delta: dict[str, Any]) -> bytes:
    body = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    body["choices"] = [{"index": index, "delta": delta, "finish_reason": None}]
    return b"data: " + orjson.dumps(body) + b"\n\n"


USAGE = b'data: {"id":"chatcmpl-s","choices":[],"usage":{"prompt_tokens":5}}\n\n'
EVENTS = [
    chunk(0, {"role": "assistant", "content": ""}),
    chunk(1, {"role": "assistant", "content": ""}),
    chunk(0, {"content": "Hel"}),
    chunk(1, {"content": "lo"}),
    USAGE,
    b"data: [DONE]\n\n",
]


def streaming_handler(writer: RingWriter | None, events: list[bytes] = EVENTS) -> Any:
    async def handle(request: httpx.Request) -> httpx.Response:
        flagged = REQUEST_KEY_ENTRY.encode() in request.content
        if flagged and writer is not None:
            key = forwarded_key(request)
            writer.publish(key, vector_bytes(vector_for(key)), position=4, num_prompt_tokens=5)

        async def produce() -> AsyncIterator[bytes]:
            for event in events:  # split mid-event, as TCP may
                yield event[:7]
                yield event[7:]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    return handle


def flagged_stream(**kv: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "n": 2,
        "kv_transfer_params": {"return_last_hidden_state": True, **kv},
    }


async def test_vector_on_first_choice_chunk_rest_byte_identical(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    key = forwarded_key(vllm.requests[0])
    body = response.content
    first_end = body.index(b"\n\n") + 2
    first = orjson.loads(body[len(b"data: ") : first_end - 2])
    assert first["kv_transfer_params"] == {"last_hidden_state": vector_for(key)}
    first.pop("kv_transfer_params")
    assert b"data: " + orjson.dumps(first) + b"\n\n" == EVENTS[0]
    assert body[first_end:] == b"".join(EVENTS[1:])
    # vLLM never sees the proxy's own keys
    sent = orjson.loads(vllm.requests[0].content)
    assert "kv_transfer_params" not in sent
    assert "accept-encoding" not in vllm.requests[0].headers


async def test_base64_and_info_on_the_stream(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(
            CHAT,
            json=flagged_stream(last_hidden_state_format="base64", last_hidden_state_info=True),
        )
    key = forwarded_key(vllm.requests[0])
    first = orjson.loads(response.content.split(b"\n\n")[0][len(b"data: ") :])
    kv = first["kv_transfer_params"]
    raw = base64.b64decode(kv["last_hidden_state"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector_for(key)
    assert kv["last_hidden_state_info"] == {
        "position": 4,
        "num_prompt_tokens": 5,
        "hidden_size": len(vector_for(key)),
        "dtype": "float32",
        "layer": "final_norm",
    }


async def test_unflagged_stream_is_relayed_untouched(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    body = flagged_stream()
    del body["kv_transfer_params"]
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.content == b"".join(EVENTS)


async def test_missing_vector_is_504_before_any_stream_byte(ring_dir: str) -> None:
    ring = FakeRing()  # present, never has the record
    vllm = FakeVLLM(streaming_handler(None))
    async with proxy_client(settings_for(ring_dir, vector_timeout=0.05), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


async def test_error_only_stream_passes_through_without_lookup(ring_dir: str) -> None:
    events = [b'data: {"error": {"message": "bad", "code": 400}}\n\n', b"data: [DONE]\n\n"]
    ring = FakeRing()
    vllm = FakeVLLM(streaming_handler(None, events))
    async with proxy_client(settings_for(ring_dir), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 200
    assert response.content == b"".join(events)
    assert ring.lookups == 0


async def test_stream_breaking_before_first_choice_is_502(ring_dir: str) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        async def produce() -> AsyncIterator[bytes]:
            yield b'data: {"id": "x", "cho'
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 502
    assert "connection reset" in error_of(response)["message"]
