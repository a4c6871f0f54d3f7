"""Flagged /v1/completions: one prompt -> one vector; a list -> one vector per prompt, in order."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.proxy.completions import merge_completions, prompt_list
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import (
    FakeVLLM,
    error_of,
    forwarded_key,
    proxy_client,
    settings_for,
    vector_bytes,
    vector_for,
)

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
FLAG = {"return_last_hidden_state": True}


def answer(prompt: Any, n: int = 1) -> dict[str, Any]:
    return {
        "id": f"cmpl-{prompt}",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": i, "text": f"{prompt}/{i}", "finish_reason": "length"} for i in range(n)
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
        "kv_transfer_params": None,
    }


class CompletionsVLLM:
    """Publishes each request's vector after a random delay, so answers finish out of order."""

    def __init__(self, writer: RingWriter, fail_prompt: str | None = None) -> None:
        self.writer = writer
        self.fail_prompt = fail_prompt
        self.keys: dict[str, bytes] = {}  # prompt (as JSON) -> key it was sent with

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        document = orjson.loads(request.content)
        prompt = document["prompt"]
        if prompt == self.fail_prompt:
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        await anyio.sleep(random.uniform(0, 0.01))
        if REQUEST_KEY_ENTRY in document.get("vllm_xargs", {}):
            key = forwarded_key(request)
            self.keys[orjson.dumps(prompt).decode()] = key
            self.writer.publish(key, vector_bytes(vector_for(key)), position=2, num_prompt_tokens=3)
        return httpx.Response(200, json=answer(prompt, document.get("n", 1)))


async def test_a_list_of_prompts_gets_one_vector_each_in_prompt_order(
    ring_dir: str, writer: RingWriter
) -> None:
    prompts: list[Any] = ["a", "b", "h", "c", "d", "e", "f", "g"]
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"model": "m", "prompt": prompts, "n": 2, "kv_transfer_params": FLAG}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = body["kv_transfer_params"]["last_hidden_states"]
    expected = [vector_for(handler.keys[orjson.dumps(p).decode()]) for p in prompts]
    assert vectors == expected
    assert len({bytes(str(v), "ascii") for v in vectors}) == len(prompts)  # distinct keys
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(prompts)))
    assert [c["text"] for c in body["choices"][:4]] == ["a/0", "a/1", "b/0", "b/1"]
    assert body["usage"] == {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40}
    assert body["id"] == "cmpl-a"


async def test_single_prompt_forms_get_the_singular_field(
    ring_dir: str, writer: RingWriter
) -> None:
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        for prompt in ("hello", [1, 2, 3]):
            response = await proxy.client.post(
                COMPLETIONS,
                json={
                    "prompt": prompt,
                    "kv_transfer_params": {**FLAG, "last_hidden_state_info": True},
                },
            )
            assert response.status_code == 200, response.text
            kv = response.json()["kv_transfer_params"]
            key = handler.keys[orjson.dumps(prompt).decode()]
            assert kv["last_hidden_state"] == vector_for(key)
            assert kv["last_hidden_state_info"]["position"] == 2


async def test_list_with_infos(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={"prompt": ["x"], "kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
        )
    kv = response.json()["kv_transfer_params"]
    assert len(kv["last_hidden_states"]) == 1
    assert [i["num_prompt_tokens"] for i in kv["last_hidden_state_infos"]] == [3]


async def test_one_failing_prompt_fails_the_request_with_vllms_error(
    ring_dir: str, writer: RingWriter
) -> None:
    handler = CompletionsVLLM(writer, fail_prompt="bad")
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["ok", "bad", "ok2"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "too long", "code": 400}}


async def test_missing_vector_for_one_prompt_is_504(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        document = orjson.loads(request.content)
        if document["prompt"] != "lost":
            key = forwarded_key(request)
            writer.publish(key, vector_bytes(vector_for(key)), position=0, num_prompt_tokens=1)
        return httpx.Response(200, json=answer(document["prompt"]))

    settings = settings_for(ring_dir, vector_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["a", "lost", "b"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"prompt": "x"}, None),
        ({"prompt": [1, 2]}, None),
        ({"prompt": ["x"]}, ["x"]),
        ({"prompt": [[3], [1, 2]]}, [[3], [1, 2]]),
        ({"prompt_embeds": "AAAA"}, None),
        ({"prompt_embeds": ["AAAA"]}, None),
    ],
)
def test_prompt_list(document: dict[str, Any], expected: list[Any] | None) -> None:
    assert prompt_list(document) == expected


@pytest.mark.parametrize(
    "document",
    [
        {"prompt": []},
        {"prompt": [True, 1]},
        {"prompt": ["a", {"x": 1}]},
        {"prompt": ["a", [1, 2]]},  # vLLM takes no mixed lists either
        {"prompt": [[1], "a"]},
        {"prompt": ["a", "b"], "stream": True},
        {"prompt": "a", "prompt_embeds": "AAAA"},
    ],
)
def test_prompt_list_refusals(document: dict[str, Any]) -> None:
    with pytest.raises(ProxyError) as caught:
        prompt_list(document)
    assert caught.value.status == 400


def test_merge_sums_cached_tokens_and_drops_per_stream_metrics() -> None:
    parts = [answer("a"), answer("b")]
    for part in parts:
        part["usage"]["prompt_tokens_details"] = {"cached_tokens": 2}
        part["metrics"] = {"ttft": 1.0}
    merged = merge_completions(parts)
    assert merged["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert merged["metrics"] is None
    assert [c["index"] for c in merged["choices"]] == [0, 1]
