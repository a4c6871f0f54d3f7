"""Stream rewriting (proxy/streams/prompt_vectors.py): the vectors ride on the first server-sent
event that carries a choice; every other byte is relayed unchanged."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    FakeRing,
    FakeVLLM,
    Handler,
    Hook,
    error_of,
    forwarded_key,
    is_keyed,
    proxy_client,
    publish_for,
    settings_for,
    vector_for,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.streams.prompt_vectors import (
    ChoiceEvent,
    FirstChoiceScanner,
    StreamEnded,
    replace_event,
)
from vllm_hidden_state_proxy.ring import RingWriter

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"

# ---------------------------------------------------------------------------------------------
# the scanner
# ---------------------------------------------------------------------------------------------

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}'
STREAM = b": comment\n\n" + USAGE + b"\n\n" + ROLE + b"\n\n" + b"data: [DONE]\n\n"


def scan_in_pieces(stream: bytes, size: int) -> tuple[ChoiceEvent | StreamEnded | None, bytes]:
    scanner = FirstChoiceScanner()
    buffer = bytearray()
    for start in range(0, len(stream), size):
        buffer += stream[start : start + size]
        found = scanner.scan(buffer)
        if found is not None:
            return found, bytes(buffer)
    return None, bytes(buffer)


@pytest.mark.parametrize("size", [1, 2, 7, 64, 10_000])
def test_the_first_choice_event_is_found_at_any_chunking(size: int) -> None:
    found, buffer = scan_in_pieces(STREAM, size)
    assert isinstance(found, ChoiceEvent)
    assert buffer[found.start : found.end] == ROLE
    assert found.chunk["choices"][0]["delta"] == {"role": "assistant"}


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_other_line_endings(newline: bytes) -> None:
    found, buffer = scan_in_pieces(STREAM.replace(b"\n", newline), 5)
    assert isinstance(found, ChoiceEvent)
    assert buffer[found.start : found.end] == ROLE


def test_data_split_over_several_lines_is_joined() -> None:
    event = b'data: {"choices":\ndata: [{"index": 0}]}\n\n'
    found = FirstChoiceScanner().scan(event)
    assert isinstance(found, ChoiceEvent) and found.chunk == {"choices": [{"index": 0}]}


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices": "x"}',
        b'data: {"choices": {"0": 1}}',
        b'data: {"choices": [1]',  # truncated JSON
        b"data: [1, 2]",
        b"event: message\nid: 7",
        b"retry: 10",
    ],
)
def test_events_without_a_choice_list_are_skipped(event: bytes) -> None:
    found = FirstChoiceScanner().scan(event + b"\n\n" + ROLE + b"\n\n")
    assert isinstance(found, ChoiceEvent) and found.chunk["id"] == "c"


def test_done_before_any_choice_ends_the_scan_with_the_first_error() -> None:
    error = b'{"error": {"message": "boom", "code": 400}}'
    later = b'data: {"error": {"message": "later"}}\n\n'
    stream = b"data: " + error + b"\n\n" + later + b"data:[DONE] \n\n" + ROLE + b"\n\n"
    found, _ = scan_in_pieces(stream, 3)
    assert found == StreamEnded(error)
    assert FirstChoiceScanner().scan(b"data: [DONE]\n\n") == StreamEnded(None)


def test_an_incomplete_event_needs_more_bytes() -> None:
    assert FirstChoiceScanner().scan(ROLE) is None
    assert FirstChoiceScanner().scan(ROLE + b"\n") is None


def test_replace_event_keeps_every_other_byte() -> None:
    found, buffer = scan_in_pieces(STREAM, 4)
    assert isinstance(found, ChoiceEvent)
    out = replace_event(buffer, found, {**found.chunk, "kv_transfer_params": {"v": 1}})
    before, after = buffer[: found.start], buffer[found.end :]
    assert out.startswith(before) and out.endswith(after)
    middle = out[len(before) : len(out) - len(after)]
    assert middle.startswith(b"data: ")
    assert orjson.loads(middle[6:])["kv_transfer_params"] == {"v": 1}


def test_replace_event_of_a_chunk_too_deep_to_write_is_502() -> None:
    deep: Any = 0
    for _ in range(300):
        deep = [deep]
    found = ChoiceEvent(0, 5, {"choices": [deep]})
    with pytest.raises(ProxyError) as caught:
        replace_event(b"data: x\n\n", found, found.chunk)
    assert caught.value.status == 502 and "re-encode" in caught.value.message


# ---------------------------------------------------------------------------------------------
# flagged streams through the app
# ---------------------------------------------------------------------------------------------


def chunk(index: int, delta: dict[str, Any]) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "model": "m"}
    body["choices"] = [{"index": index, "delta": delta, "finish_reason": None}]
    return b"data: " + orjson.dumps(body) + b"\n\n"


STREAM_USAGE = b'data: {"id":"chatcmpl-s","choices":[],"usage":{"prompt_tokens":5}}\n\n'
EVENTS = [
    chunk(0, {"role": "assistant", "content": ""}),
    chunk(1, {"role": "assistant", "content": ""}),
    chunk(0, {"content": "Hel"}),
    chunk(1, {"content": "lo"}),
    STREAM_USAGE,
    b"data: [DONE]\n\n",
]


def streaming_handler(hook: Hook, events: list[bytes] = EVENTS) -> Handler:
    async def handle(request: httpx.Request) -> httpx.Response:
        if is_keyed(request):
            publish_for(hook, request)

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


def first_event(body: bytes) -> tuple[dict[str, Any], bytes]:
    """The first event's chunk, and every byte after that event."""
    end = body.index(b"\n\n") + 2
    chunk: dict[str, Any] = orjson.loads(body[len(b"data: ") : end - 2])
    return chunk, body[end:]


async def test_the_vector_rides_on_the_first_choice_chunk_the_rest_is_byte_identical(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert "content-length" not in response.headers
    key = forwarded_key(vllm.requests[0])
    first, rest = first_event(response.content)
    assert first.pop("kv_transfer_params") == {"last_hidden_state": vector_for(key)}
    assert b"data: " + orjson.dumps(first) + b"\n\n" == EVENTS[0]
    assert rest == b"".join(EVENTS[1:])
    sent = orjson.loads(vllm.requests[0].content)
    assert "kv_transfer_params" not in sent  # vLLM never sees the proxy's own fields
    assert "accept-encoding" not in vllm.requests[0].headers


async def test_base64_and_info_on_the_stream(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(
            CHAT,
            json=flagged_stream(last_hidden_state_format="base64", last_hidden_state_info=True),
        )
    key = forwarded_key(vllm.requests[0])
    kv = first_event(response.content)[0]["kv_transfer_params"]
    raw = base64.b64decode(kv["last_hidden_state"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector_for(key)
    assert kv["last_hidden_state_info"] == {
        "position": 4,
        "num_prompt_tokens": 5,
        "hidden_size": 8,
        "dtype": "float32",
        "pooling": "last",
        "layer": "final_norm",
    }


async def test_layers_and_mean_pooling_on_the_stream(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    vllm = FakeVLLM(streaming_handler(layered_writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(
            CHAT,
            json=flagged_stream(last_hidden_state_layers=[0, 2], last_hidden_state_pooling="mean"),
        )
    key = forwarded_key(vllm.requests[0])
    first, rest = first_event(response.content)
    assert first["kv_transfer_params"] == {
        "last_hidden_states_by_layer": {
            "0": vector_for(key, 0, "mean"),
            "2": vector_for(key, 2, "mean"),
        }
    }
    assert rest == b"".join(EVENTS[1:])
    assert "cache_salt" in orjson.loads(vllm.requests[0].content)


async def test_an_unflagged_stream_is_relayed_untouched(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(streaming_handler(writer))
    body = flagged_stream()
    del body["kv_transfer_params"]
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.content == b"".join(EVENTS)


async def test_a_missing_vector_is_504_before_any_stream_byte() -> None:
    ring = FakeRing()  # live, never has the record
    vllm = FakeVLLM(streaming_handler(None))
    async with proxy_client(settings_for("/unused", vector_timeout=0.05), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


VLLM_ERROR = b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}'


@pytest.mark.parametrize("done", [True, False], ids=["with DONE", "body ends"])
async def test_an_error_only_stream_is_vllms_error_with_its_status_not_a_200(done: bool) -> None:
    """vLLM failed before its first output: its in-stream error, as a JSON error response."""
    events = [b"data: " + VLLM_ERROR + b"\n\n", *([b"data: [DONE]\n\n"] if done else [])]
    ring = FakeRing()
    vllm = FakeVLLM(streaming_handler(None, events))
    async with proxy_client(settings_for("/unused"), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert (response.status_code, response.content) == (400, VLLM_ERROR)
    assert response.headers["content-type"] == "application/json"
    assert ring.lookups == 0


@pytest.mark.parametrize(
    ("events", "status", "message"),
    [
        ([b"data: [DONE]\n\n"], 502, "ended before its first choice"),
        ([STREAM_USAGE], 502, "ended before its first choice"),
        (
            [b'data: {"error": {"message": "odd", "type": "t", "param": null, "code": "x"}}\n\n'],
            502,
            "odd",
        ),
        (
            [b'data: {"error": {"message": "dead", "type": "t", "param": null, "code": 500}}\n\n'],
            500,
            "dead",
        ),
    ],
)
async def test_a_stream_ending_before_a_choice_is_never_a_200(
    events: list[bytes], status: int, message: str
) -> None:
    vllm = FakeVLLM(streaming_handler(None, events))
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == status
    assert message in error_of(response)["message"]


async def test_a_first_choice_of_megabytes_gets_its_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    """Echo, logprobs or token ids of a long prompt ride on the first choice: megabytes."""
    big = chunk(0, {"role": "assistant", "content": "x" * (3 << 20)})
    pieces = [big[start : start + 65536] for start in range(0, len(big), 65536)]
    vllm = FakeVLLM(streaming_handler(writer, [*pieces, *EVENTS[1:]]))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 200
    first, rest = first_event(response.content)
    assert first.pop("kv_transfer_params") == {
        "last_hidden_state": vector_for(forwarded_key(vllm.requests[0]))
    }
    assert b"data: " + orjson.dumps(first) + b"\n\n" == big
    assert rest == b"".join(EVENTS[1:])


async def test_a_stream_breaking_before_its_first_choice_is_502() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        async def produce() -> AsyncIterator[bytes]:
            yield b'data: {"id": "x", "cho'
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), FakeRing()) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
        assert proxy.metrics.upstream_errors == 1
    assert response.status_code == 502
    assert "The exchange with vLLM failed" in error_of(response)["message"]


async def test_a_stream_without_a_choice_in_its_first_bytes_is_502() -> None:
    limit = 1 << 20
    ring = FakeRing()
    comments = b": " + b"x" * 1000 + b"\n\n"

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)

        async def produce() -> AsyncIterator[bytes]:
            for _ in range(limit // len(comments) + 2):
                yield comments
            yield EVENTS[0]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=produce())

    settings = settings_for("/unused", max_answer_bytes=limit)
    async with proxy_client(settings, FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream())
    assert response.status_code == 502
    assert f"first {limit} bytes (the proxy's --max-answer-size)" in error_of(response)["message"]


async def test_a_stream_whose_record_lacks_a_layer_is_502_before_any_byte(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        vectors = struct.pack("<8f", *vector_for(key))
        layered_writer.publish(key, vectors, position=1, num_prompt_tokens=2, layers=(FINAL,))
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"".join(EVENTS)
        )

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged_stream(last_hidden_state_layers=[0]))
    assert response.status_code == 502
    assert "different releases" in error_of(response)["message"]
