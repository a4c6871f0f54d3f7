"""The instant upstream (benchmarks/instant_upstream.py), in process through httpx's ASGI
transport."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import orjson
from benchmarks.instant_upstream import (
    HIDDEN_SIZE,
    PROMPT_TOKENS,
    instant_app,
    ring_publisher,
)

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, new_request_key, request_key_to_wire
from vllm_hidden_state_proxy.ring import Record, RingDirectory


def ask(
    app_publish: Callable[[bytes], None], method: str, path: str, body: bytes = b""
) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=instant_app(app_publish))
        async with httpx.AsyncClient(transport=transport, base_url="http://instant") as client:
            return await client.request(method, path, content=body)

    return anyio.run(main)


def test_every_chat_gets_a_canned_one_token_answer_and_nothing_else_is_there() -> None:
    published: list[bytes] = []
    answer = ask(published.append, "POST", "/v1/chat/completions", b'{"messages":[]}')
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    completion = answer.json()
    assert completion["choices"][0]["message"]["content"] == "x"
    assert completion["usage"]["completion_tokens"] == 1
    assert ask(published.append, "GET", "/health").status_code == 200
    assert ask(published.append, "GET", "/v1/models").status_code == 404
    assert published == []  # unflagged bodies are not looked into


def test_a_streamed_chat_gets_server_sent_events() -> None:
    answer = ask(lambda body: None, "POST", "/v1/chat/completions", b'{"stream":true}')
    assert answer.headers["content-type"] == "text/event-stream"
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"]["content"] == "x"
    assert chunks[2]["usage"]["prompt_tokens"] == PROMPT_TOKENS


def test_a_flagged_chat_finds_its_vector_in_a_real_ring(tmp_path: Path) -> None:
    key = new_request_key()
    body = orjson.dumps(
        {"messages": [], "vllm_xargs": {REQUEST_KEY_ENTRY: request_key_to_wire(key), "x": 1}}
    )
    publish = ring_publisher(tmp_path / "rings")
    assert ask(publish, "POST", "/v1/chat/completions", body).status_code == 200
    with RingDirectory(tmp_path / "rings") as rings:
        record = rings.lookup(key)
        assert rings.has_ring()
    assert isinstance(record, Record) and record.num_prompt_tokens == PROMPT_TOKENS
    values = struct.unpack(f"<{HIDDEN_SIZE}f", record.vector(record.layers[0]))
    assert len(values) == HIDDEN_SIZE and values[1] > values[0]
    publish(orjson.dumps({"vllm_xargs": {REQUEST_KEY_ENTRY: "not a key"}}))  # ignored, not an error
