"""Request bodies and timed calls (bench/client.py), against httpx.MockTransport."""

from __future__ import annotations

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack, Timed, chat_body, timed_post


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
