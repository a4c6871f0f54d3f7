"""``POST /v1/responses`` (proxy/endpoints/__init__.py, streams/responses.py): a flagged answer gets
its vectors in ``kv_transfer_params``, a flagged stream in its ``response.completed`` event; every
other byte of the stream is vLLM's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    FakeRing,
    FakeVLLM,
    error_of,
    forwarded_key,
    proxy_client,
    publish_for,
    settings_for,
    vector_for,
)
from vllm_hidden_state_proxy.proxy.streams.responses import CompletedJoiner

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"
FLAG = {"return_last_hidden_state": True}


def final_response(kv: Any = None) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
        "kv_transfer_params": kv,
    }


def event(kind: str, **fields: Any) -> bytes:
    data = orjson.dumps({**fields, "type": kind})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


STREAM = [
    event("response.created", response={**final_response(), "status": "in_progress"}),
    event("response.in_progress", response={**final_response(), "status": "in_progress"}),
    event("response.output_item.added", item={"type": "message"}, output_index=0),
    event("response.output_text.delta", delta="hi", output_index=0),
    event("response.completed", response=final_response(), sequence_number=4),
]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hello", "kv_transfer_params": FLAG, **extra}


async def test_a_flagged_response_gets_its_vector_in_kv_transfer_params() -> None:
    ring = FakeRing()
    sent: list[dict[str, Any]] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        sent.append(orjson.loads(request.content))
        publish_for(ring, request)
        return httpx.Response(200, json=final_response())

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(RESPONSES, json=body(instructions="Be brief."))
    assert response.status_code == 200
    answer = response.json()
    key = bytes.fromhex(sent[0]["vllm_xargs"]["hidden_state_proxy_key"])
    assert answer["kv_transfer_params"]["last_hidden_state"] == pytest.approx(
        vector_for(key, FINAL)
    )
    assert answer["output"] == final_response()["output"]
    # What vLLM got: the client's request, the proxy's fields swapped for a fresh key.
    assert sent[0]["instructions"] == "Be brief." and "kv_transfer_params" not in sent[0]


def chunks_of(stream: list[bytes], size: int) -> list[bytes]:
    whole = b"".join(stream)
    return [whole[i : i + size] for i in range(0, len(whole), size)]


@pytest.mark.parametrize("size", [1, 7, 1 << 16], ids=["bytewise", "small", "whole"])
async def test_a_flagged_stream_gets_its_vector_on_response_completed_only(size: int) -> None:
    ring = FakeRing()
    keys: list[bytes] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        keys.append(publish_for(ring, request))

        async def produce() -> AsyncIterator[bytes]:
            for piece in chunks_of(STREAM, size):
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(RESPONSES, json=body(stream=True))
    assert response.status_code == 200
    events = response.content.split(b"\n\n")
    assert events[-1] == b""
    # Every event but the last is vLLM's, byte for byte; the last keeps its event: line.
    assert [e + b"\n\n" for e in events[:-2]] == STREAM[:-1]
    name, data = events[-2].split(b"\n", 1)
    assert name == b"event: response.completed" and data.startswith(b"data: ")
    completed = orjson.loads(data[len(b"data: ") :])
    assert completed["sequence_number"] == 4 and completed["type"] == "response.completed"
    vector = completed["response"]["kv_transfer_params"]["last_hidden_state"]
    assert vector == pytest.approx(vector_for(keys[0], FINAL))
    assert {**completed["response"], "kv_transfer_params": None} == final_response()


async def test_a_stream_whose_vector_is_missing_is_an_error_before_any_byte() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        forwarded_key(request)  # flagged, but nothing is published

        async def produce() -> AsyncIterator[bytes]:
            for piece in STREAM:
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    settings = settings_for("/unused", vector_timeout=0.01)
    async with proxy_client(settings, FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.post(RESPONSES, json=body(stream=True))
    assert response.status_code == 504
    assert response.headers["content-type"] == "application/json"


async def test_a_stream_that_fails_before_any_output_is_a_502_with_vllm_s_event() -> None:
    failed = event("error", code="server_error", message="engine dead")

    async def handle(request: httpx.Request) -> httpx.Response:
        forwarded_key(request)
        content = STREAM[0] + STREAM[1] + failed
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=content)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.post(RESPONSES, json=body(stream=True))
    assert response.status_code == 502
    assert "engine dead" in error_of(response)["message"]


def test_the_joiner_passes_whole_events_and_holds_a_partial_one() -> None:
    joiner = CompletedJoiner({"last_hidden_state": "AAAA"}, limit=1 << 20)
    whole = b"".join(STREAM)
    cut = whole.index(b"response.completed") + 5
    first = joiner.feed(whole[:cut])
    assert first == b"".join(STREAM[:-1])  # the completed event waits for its end
    rest = joiner.feed(whole[cut:]) + joiner.finish()
    assert joiner.joined and b'"kv_transfer_params":{"last_hidden_state":"AAAA"}' in rest
    assert rest.startswith(b"event: response.completed\ndata: {") and rest.endswith(b"\n\n")
