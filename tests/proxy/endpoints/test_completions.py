"""``POST /v1/completions`` (proxy/endpoints/completions.py): one prompt gets one vector; a flagged
list of prompts fans out, one request key each, and gets one entry per prompt, in prompt order."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FakeRing,
    FakeVLLM,
    Hook,
    error_of,
    forwarded_key,
    is_keyed,
    proxy_client,
    publish_for,
    settings_for,
    vector_for,
)
from vllm_hidden_state_proxy.proxy.endpoints.completions import merge_completions, prompt_list
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.ring import RingWriter

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
FLAG = {"return_last_hidden_state": True}


def reply(prompt: Any, n: int = 1) -> dict[str, Any]:
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
    """Publishes each request's record after a random delay, so answers finish out of order;
    answers 400 for ``fail_prompt`` and publishes nothing for ``lost_prompt``."""

    def __init__(
        self, hook: Hook, fail_prompt: str | None = None, lost_prompt: str | None = None
    ) -> None:
        self.hook = hook
        self.fail_prompt = fail_prompt
        self.lost_prompt = lost_prompt
        self.keys: dict[str, bytes] = {}  # prompt (as JSON) -> the key it was sent with

    def key_of(self, prompt: Any) -> bytes:
        return self.keys[orjson.dumps(prompt).decode()]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        document = orjson.loads(request.content)
        prompt = document["prompt"]
        if prompt == self.fail_prompt:
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        await anyio.sleep(random.uniform(0, 0.005))
        if is_keyed(request) and prompt != self.lost_prompt:
            self.keys[orjson.dumps(prompt).decode()] = publish_for(self.hook, request)
        return httpx.Response(200, json=reply(prompt, document.get("n", 1)))


async def test_a_list_of_prompts_gets_one_vector_each_in_prompt_order(
    ring_dir: str, writer: RingWriter
) -> None:
    prompts: list[Any] = ["a", "b", "h", "c", "d", "e", "f", "g"]
    handler = CompletionsVLLM(writer)
    settings = settings_for(ring_dir, fan_out_limit=3)
    async with proxy_client(settings, FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"model": "m", "prompt": prompts, "n": 2, "kv_transfer_params": FLAG}
        )
        assert proxy.metrics.requests["flagged"] == 1
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = body["kv_transfer_params"]["last_hidden_states"]
    assert vectors == [vector_for(handler.key_of(p)) for p in prompts]
    assert len(set(handler.keys.values())) == len(prompts)  # one key per prompt
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(prompts)))
    assert [c["text"] for c in body["choices"][:4]] == ["a/0", "a/1", "b/0", "b/1"]
    assert body["usage"] == {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40}
    assert body["id"] == "cmpl-a"


async def test_token_id_lists_fan_out_too(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer)
    prompts = [[1, 2], [3], [4, 5, 6]]
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": prompts, "kv_transfer_params": FLAG}
        )
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_states"] == [vector_for(handler.key_of(p)) for p in prompts]


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
            assert kv["last_hidden_state"] == vector_for(handler.key_of(prompt))
            assert kv["last_hidden_state_info"]["position"] == 4


async def test_a_list_with_infos(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={"prompt": ["x"], "kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
        )
    kv = response.json()["kv_transfer_params"]
    assert len(kv["last_hidden_states"]) == 1
    assert [info["num_prompt_tokens"] for info in kv["last_hidden_state_infos"]] == [5]


async def test_a_list_with_layers_gets_one_object_per_prompt(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    handler = CompletionsVLLM(layered_writer)
    prompts = ["p", "q", "r"]
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={
                "prompt": prompts,
                "kv_transfer_params": {
                    **FLAG,
                    "last_hidden_state_layers": [0, -1],
                    "last_hidden_state_pooling": "mean",
                    "last_hidden_state_info": True,
                },
            },
        )
    assert response.status_code == 200, response.text
    kv = response.json()["kv_transfer_params"]
    keys = [handler.key_of(p) for p in prompts]
    assert kv["last_hidden_states_by_layer"] == [
        {"0": vector_for(k, 0, "mean"), "-1": vector_for(k, 4, "mean")} for k in keys
    ]
    assert kv["last_hidden_states"] == [vector_for(k, 4, "mean") for k in keys]
    assert [info["layers"] for info in kv["last_hidden_state_infos"]] == [[0, -1]] * 3
    assert [info["pooling"] for info in kv["last_hidden_state_infos"]] == ["mean"] * 3


async def test_a_list_with_layers_but_not_the_final_one(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    handler = CompletionsVLLM(layered_writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={
                "prompt": ["p", "q"],
                "kv_transfer_params": {**FLAG, "last_hidden_state_layers": [2]},
            },
        )
    kv = response.json()["kv_transfer_params"]
    assert set(kv) == {"last_hidden_states_by_layer"}
    assert kv["last_hidden_states_by_layer"] == [
        {"2": vector_for(handler.key_of(p), 2)} for p in ("p", "q")
    ]


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


async def test_a_missing_vector_for_one_prompt_is_504(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer, lost_prompt="lost")
    settings = settings_for(ring_dir, vector_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["a", "lost", "b"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


@pytest.mark.parametrize(
    "reply_body",
    [
        {"id": "x", "choices": [], "usage": {"prompt_tokens": "abc"}},
        {"id": "x", "choices": 5},
    ],
    ids=["usage-not-a-number", "choices-not-a-list"],
)
async def test_replies_that_cannot_be_merged_are_502(reply_body: dict[str, Any]) -> None:
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        return httpx.Response(200, json=reply_body)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["a", "b"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 502
    assert "cannot be merged" in error_of(response)["message"]


async def test_an_unflagged_list_goes_to_vllm_as_one_request() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=reply("list"))

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(COMPLETIONS, json={"prompt": ["a", "b"]})
    assert response.status_code == 200
    assert len(vllm.requests) == 1


async def test_a_flagged_single_prompt_stream_is_served(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        publish_for(writer, request)
        event = orjson.dumps({"id": "c", "choices": [{"index": 0, "text": key.hex()[:4]}]})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=b"data: " + event + b"\n\ndata: [DONE]\n\n",
        )

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": "x", "stream": True, "kv_transfer_params": FLAG}
        )
    first = orjson.loads(response.content.split(b"\n\n")[0][len(b"data: ") :])
    assert "last_hidden_state" in first["kv_transfer_params"]


# ---------------------------------------------------------------------------------------------
# prompt_list and merge_completions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"prompt": "x"}, None),
        ({}, None),
        ({"prompt": [1, 2]}, None),
        ({"prompt": ["x"]}, ["x"]),
        ({"prompt": ["x", "y"], "stream": False}, ["x", "y"]),
        ({"prompt": [[3], [1, 2]]}, [[3], [1, 2]]),
        ({"prompt_embeds": "AAAA"}, None),
        ({"prompt_embeds": ["AAAA"]}, None),
    ],
)
def test_prompt_list(document: dict[str, Any], expected: list[Any] | None) -> None:
    assert prompt_list(document, 2048) == expected


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [True, 1]}, "prompt"),
        ({"prompt": ["a", {"x": 1}]}, "prompt"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # vLLM takes no mixed lists either
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "stream"),
        ({"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt_embeds": ["AAAA", "BBBB"]}, "prompt_embeds"),
    ],
)
def test_prompt_list_refusals(document: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        prompt_list(document, 2048)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("prompt", [["x"] * 3, [[1]] * 3])
def test_prompt_list_over_the_limit_is_refused_naming_it(prompt: list[Any]) -> None:
    assert prompt_list({"prompt": prompt[:2]}, 2) == prompt[:2]
    with pytest.raises(ProxyError) as caught:
        prompt_list({"prompt": prompt}, 2)
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert "list of 3 prompts" in caught.value.message
    assert "at most 2" in caught.value.message and "--max-prompts" in caught.value.message


def test_merge_renumbers_choices_and_sums_usage() -> None:
    merged = merge_completions([reply("a", 2), reply("b", 1)])
    assert merged["id"] == "cmpl-a"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a/0"),
        (1, "a/1"),
        (2, "b/0"),
    ]
    assert merged["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}


def test_merge_sums_cached_tokens_and_drops_per_stream_metrics() -> None:
    parts = [reply("a"), reply("b")]
    for part in parts:
        part["usage"]["prompt_tokens_details"] = {"cached_tokens": 2}
        part["metrics"] = {"ttft": 1.0}
    merged = merge_completions(parts)
    assert merged["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert merged["metrics"] is None


def test_merge_without_usage_adds_none() -> None:
    parts = [{**reply("a"), "usage": None}, {**reply("b"), "usage": None}]
    assert merge_completions(parts)["usage"] is None
