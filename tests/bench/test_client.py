"""Request bodies and timed calls (bench/client.py), against httpx.MockTransport."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.bench.client import (
    BenchError,
    ChatStack,
    StreamTiming,
    Timed,
    chat_body,
    embedding_chat_body,
    embedding_inputs_body,
    embedding_text,
    timed_post,
    timed_stream,
    tokens_in_event,
)
from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    EmbeddingsDefaults,
    plan_embeddings,
)


def test_chat_bodies_flag_only_what_the_arm_asks_for() -> None:
    plain = orjson.loads(chat_body("m", 7))
    assert plain["max_tokens"] == 1 and plain["ignore_eos"] is True
    assert "kv_transfer_params" not in plain and "stream" not in plain
    assert "request 7" in plain["messages"][0]["content"]
    assert orjson.loads(chat_body("m", 1, flag="float"))["kv_transfer_params"] == {
        "return_last_hidden_state": True
    }
    assert orjson.loads(chat_body("m", 1, flag="base64"))["kv_transfer_params"] == {
        "return_last_hidden_state": True,
        "last_hidden_state_format": "base64",
    }
    streamed = orjson.loads(chat_body("m", 1, max_tokens=64, stream=True))
    assert streamed["stream"] is True and streamed["max_tokens"] == 64
    assert streamed["stream_options"] == {"include_usage": True}
    assert streamed["return_token_ids"] is True


def test_embedding_inputs_are_distinct_texts_and_the_direct_chat_is_the_proxys() -> None:
    body = orjson.loads(embedding_inputs_body("m", [10, 11]))
    assert body == {
        "model": "m",
        "input": [embedding_text(10), embedding_text(11)],
        "encoding_format": "float",
    }
    plan = plan_embeddings(
        {"model": "m", "input": [embedding_text(5), embedding_text(6)]},
        EmbeddingsDefaults(template=DEFAULT_TEMPLATE, max_inputs=16),
    )
    assert [path for path, _ in plan.calls] == ["/v1/chat/completions"] * 2
    assert [orjson.loads(embedding_chat_body("m", i)) for i in (5, 6)] == [
        document for _, document in plan.calls
    ]  # the proxy adds only the flag on its way to vLLM


def test_tokens_are_counted_per_event_also_when_vllm_merges_them() -> None:
    def event(delta: dict[str, str], token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, object] = {"index": 0, "delta": delta}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return orjson.dumps({"choices": [choice]})

    assert tokens_in_event(event({"role": "assistant", "content": ""})) == 0
    assert tokens_in_event(event({"content": "ab"}, [5, 6, 7])) == 3
    assert tokens_in_event(event({"content": ""}, [9])) == 1  # a partial UTF-8 character
    assert tokens_in_event(event({"content": "x"})) == 1  # no token_ids: one per event
    assert tokens_in_event(orjson.dumps({"choices": [], "usage": {"completion_tokens": 64}})) == 0


def test_stream_timing_tells_a_burst_from_a_stream() -> None:
    assert StreamTiming(0.1, [1e-5] * 62 + [0.01], 0.2).burst
    assert not StreamTiming(0.1, [0.002] * 63, 0.3).burst


def test_an_answer_must_be_a_200_and_a_flagged_one_must_hold_its_vector() -> None:
    assert Timed(0.1, 200, b"{}").require_ok("x").seconds == 0.1
    with pytest.raises(BenchError, match="direct: HTTP 503: busy"):
        Timed(0.1, 503, b"busy").require_ok("direct")
    with pytest.raises(BenchError, match="flagged: a flagged answer without its vector"):
        Timed(0.1, 200, b"{}").require_ok("flagged", vector=True)
    Timed(0.1, 200, b'{"last_hidden_state":[1]}').require_ok("flagged", vector=True)


def test_each_key_goes_to_its_own_server_only() -> None:
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("authorization")))
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(handler)
    stack = ChatStack(
        "http://proxy", "http://vllm", "m", "s3cret", transport, vllm_api_key="vllm-secret"
    )

    async def main() -> None:
        for route in (stack.via_proxy("p", "to the proxy"), stack.direct("d", "to vLLM")):
            async with stack.client(route) as client:
                await timed_post(client, "/v1/chat/completions", b"{}")

    anyio.run(main)
    assert seen == [("proxy", "Bearer s3cret"), ("vllm", "Bearer vllm-secret")]
    assert "s3cret" not in repr(stack) and "vllm-secret" not in repr(stack)


def test_a_dropped_connection_is_a_bench_error_naming_the_url() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection closed", request=request)

    async def main() -> None:
        stack = ChatStack("http://fake", "http://fake", "m", transport=httpx.MockTransport(handler))
        async with stack.client(stack.direct("d", "")) as client:
            await timed_post(client, "/v1/chat/completions", b"{}")

    with pytest.raises(BenchError, match=r"POST http://fake/v1/chat/completions: ReadError"):
        anyio.run(main)


def sse(*events: Mapping[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_a_stream_is_timed_token_by_token_and_must_bring_every_token() -> None:
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    body = sse(role, *({"choices": [{"delta": {"content": "x"}, "token_ids": [1]}]},) * 4)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def main(expected: int) -> StreamTiming:
        async with httpx.AsyncClient(base_url="http://f", transport=transport) as client:
            return await timed_stream(client, b"{}", expected)

    timing = anyio.run(main, 4)
    assert len(timing.gaps) == 3 and 0 < timing.ttft <= timing.total
    with pytest.raises(BenchError, match="4 tokens, expected 5"):
        anyio.run(main, 5)
