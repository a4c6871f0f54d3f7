"""/v1/embeddings on the proxy: planning, fan-out, order, normalisation, formats, errors."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.proxy.embeddings_request import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_TEMPLATE,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import (
    HIDDEN_SIZE,
    FakeVLLM,
    error_of,
    forwarded_key,
    proxy_client,
    settings_for,
    vector_bytes,
    vector_for,
)

pytestmark = pytest.mark.anyio

EMBEDDINGS = "/v1/embeddings"


def plan(document: dict[str, Any], max_inputs: int = 10) -> Any:
    return plan_embeddings(document, DEFAULT_TEMPLATE, max_inputs)


def test_texts_become_templated_one_token_chat_requests_without_thinking() -> None:
    result = plan({"model": "m", "input": ["a", "b"]})
    assert [path for path, _ in result.calls] == [CHAT_PATH, CHAT_PATH]
    _, body = result.calls[1]
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": DEFAULT_TEMPLATE.replace("{text}", "b")}],
        "max_completion_tokens": 1,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert (result.encoding_format, result.normalize, result.field) == ("float", True, "input")


def test_instruction_overrides_the_template() -> None:
    result = plan({"input": "x", "instruction": "query: {text}"})
    assert result.calls[0][1]["messages"][0]["content"] == "query: x"


def test_token_ids_skip_the_template() -> None:
    assert plan({"input": [1, 2, 3]}).calls == [
        (COMPLETIONS_PATH, {"prompt": [1, 2, 3], "max_tokens": 1})
    ]
    assert [c[1]["prompt"] for c in plan({"input": [[1], [2, 3]]}).calls] == [[1], [2, 3]]


def test_messages_form_defaults_to_no_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    result = plan({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert result.field == "messages"
    assert result.calls == [
        (
            CHAT_PATH,
            {
                "messages": messages,
                "max_completion_tokens": 1,
                "add_generation_prompt": False,
                "continue_final_message": False,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
    ]


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": {"a": 1}}, "input"),
        ({"input": ["x"] * 11}, "input"),
        ({}, "input"),
        ({"input": "a", "messages": []}, "input"),
        ({"messages": []}, "messages"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "normalize": "yes"}, "normalize"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "instruction": "no placeholder"}, "instruction"),
        ({"input": [1, 2], "instruction": "q: {text}"}, "instruction"),
        ({"input": "a", "model": 3}, "model"),
        ({"messages": [{"role": "user"}], "add_generation_prompt": 1}, "add_generation_prompt"),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_bad_requests_name_their_field(document: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        plan(document)
    assert (caught.value.status, caught.value.param) == (400, param)


class ChatAndCompletionsVLLM:
    """Publishes a vector per request after a random delay; fails inputs containing 'fail'."""

    def __init__(self, writer: RingWriter) -> None:
        self.writer = writer
        self.keys: list[tuple[str, bytes]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        document = orjson.loads(request.content)
        text = str(document.get("messages") or document.get("prompt"))
        if "fail" in text:
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        await anyio.sleep((hash(text) % 10) / 1000)
        key = forwarded_key(request)
        self.keys.append((text, key))
        self.writer.publish(key, vector_bytes(vector_for(key)), position=6, num_prompt_tokens=7)
        return httpx.Response(200, json={"id": "c", "model": "served-name", "choices": []})

    def key_for(self, fragment: str) -> bytes:
        (key,) = [k for text, k in self.keys if fragment in text]
        return key


def unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


async def test_inputs_in_order_normalised_with_usage(ring_dir: str, writer: RingWriter) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    texts = [f"text number {i}" for i in range(12)]
    async with proxy_client(settings_for(ring_dir, fan_out_limit=3), FakeVLLM(vllm)) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"model": "m", "input": texts})
        assert proxy.metrics.requests["embeddings"] == 1
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "served-name"
    assert body["usage"] == {"prompt_tokens": 7 * 12, "total_tokens": 7 * 12}
    assert [d["index"] for d in body["data"]] == list(range(12))
    for text, item in zip(texts, body["data"], strict=True):
        assert item["object"] == "embedding"
        expected = unit(vector_for(vllm.key_for(f'"{text}"')))  # quoted by the template
        assert item["embedding"] == pytest.approx(expected, rel=1e-12)


async def test_base64_and_unnormalised(ring_dir: str, writer: RingWriter) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(vllm)) as proxy:
        raw = await proxy.client.post(
            EMBEDDINGS, json={"input": [[1, 2]], "normalize": False, "encoding_format": "base64"}
        )
        normed = await proxy.client.post(
            EMBEDDINGS, json={"input": [[1, 2]], "encoding_format": "base64"}
        )
    first, second = (key for _, key in vllm.keys)

    def decoded(response: httpx.Response) -> list[float]:
        data = base64.b64decode(response.json()["data"][0]["embedding"])
        return list(struct.unpack(f"<{HIDDEN_SIZE}f", data))

    assert decoded(raw) == vector_for(first)
    assert decoded(normed) == pytest.approx(unit(vector_for(second)), rel=1e-6)


async def test_a_failing_input_fails_the_request_naming_its_index(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(vllm)) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": ["ok", "ok", "fail", "ok"]})
    assert response.status_code == 400
    error = error_of(response)
    assert error["message"] == "input[2]: too long"
    assert error["param"] == "input"


async def test_dimensions_must_equal_the_hidden_size(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(ChatAndCompletionsVLLM(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        wrong = await proxy.client.post(EMBEDDINGS, json={"input": "a", "dimensions": 4})
        right = await proxy.client.post(EMBEDDINGS, json={"input": "a", "dimensions": HIDDEN_SIZE})
    assert wrong.status_code == 400
    assert "Matryoshka" in error_of(wrong)["message"]
    assert len(vllm.requests) == 1
    assert len(right.json()["data"][0]["embedding"]) == HIDDEN_SIZE


async def test_too_many_inputs_is_400_before_any_vllm_request(ring_dir: str) -> None:
    vllm = FakeVLLM(lambda request: None)  # type: ignore[arg-type,return-value]
    settings = settings_for(ring_dir, max_embedding_inputs=2)
    async with proxy_client(settings, vllm) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": ["a", "b", "c"]})
    assert response.status_code == 400
    assert "at most 2" in error_of(response)["message"]
    assert vllm.requests == []
