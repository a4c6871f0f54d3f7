"""The flagged chat path on real vLLM: every vector checked against Transformers."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS, RunningStack
from tests.e2e.stack_probe import prefix_cache_hits

#: Run on V1 and again on V2 (HSP_E2E_RUNNER=v2): what V2 changes (tests/e2e/server.py).
pytestmark = pytest.mark.both_runners

FLAG = {"kv_transfer_params": {"return_last_hidden_state": True}}

LONG_TEXT = " ".join(
    f"Sentence number {i} talks about rivers, mountains and the colour {c}."
    for i, c in enumerate(["red", "green", "blue", "yellow", "violet", "orange"] * 6)
)


def flagged(client: Any, model: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    body = {**NO_THINKING, **FLAG, "return_token_ids": True, **extra}
    return client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=1, temperature=0, extra_body=body
    )


def vector_of(response: Any) -> list[float]:
    params = response.model_dump()["kv_transfer_params"]
    assert isinstance(params, dict), f"no kv_transfer_params in {response.model_dump()}"
    vector = params["last_hidden_state"]
    assert isinstance(vector, list) and all(isinstance(x, float) for x in vector)
    return vector


def check_against_reference(
    response: Any, reference: Reference, messages: list[dict[str, Any]], **template: Any
) -> list[float]:
    """The prompt vLLM saw is the reference's prompt, and the vector is its last hidden state."""
    expected_ids = reference.chat_token_ids(messages, **template)
    assert response.model_dump()["prompt_token_ids"] == expected_ids
    vector = vector_of(response)
    assert len(vector) == reference.hidden_size
    assert_matches(vector, reference.last_hidden_state(expected_ids))
    return vector


def test_quickstart_snippet_returns_the_transformers_vector(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    from openai import OpenAI

    MODEL = model_name
    # --- verbatim from the README / issue ---
    client = OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused")
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "Summarize this text in one word: A yellow bicycle beside a stone wall.",
            }
        ],
        max_completion_tokens=1,
        n=1,
        stream=False,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "kv_transfer_params": {"return_last_hidden_state": True},
        },
    )
    vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
    # ---
    messages = [
        {
            "role": "user",
            "content": "Summarize this text in one word: A yellow bicycle beside a stone wall.",
        }
    ]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert response.usage is not None and response.usage.prompt_tokens == len(ids)
    assert len(vector) == reference.hidden_size
    assert_matches(vector, reference.last_hidden_state(ids))


def test_assistant_prefill_uses_the_unfinished_assistant_message(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [
        {"role": "user", "content": "Name a colour of the sky."},
        {"role": "assistant", "content": "The colour is"},
    ]
    response = flagged(
        client, model_name, messages, continue_final_message=True, add_generation_prompt=False
    )
    vector = check_against_reference(
        response,
        reference,
        messages,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    # The prefill position differs from the plain generation-prompt position.
    plain = flagged(client, model_name, messages[:1])
    assert vector_of(plain) != vector


def test_chunked_prefill_takes_the_row_from_the_last_chunk(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Chunked: " + LONG_TEXT}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS, "prompt must span several prefill chunks"
    response = flagged(client, model_name, messages)
    check_against_reference(response, reference, messages, enable_thinking=False)


def test_repeated_prompt_hits_the_prefix_cache_and_gets_the_same_vector(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Prefix cache: " + LONG_TEXT}]
    first = flagged(client, model_name, messages)
    hits_before = prefix_cache_hits(stack)
    second = flagged(client, model_name, messages)
    hits_after = prefix_cache_hits(stack)
    assert hits_after > hits_before, "the second request should hit vLLM's prefix cache"
    check_against_reference(first, reference, messages, enable_thinking=False)
    check_against_reference(second, reference, messages, enable_thinking=False)


def test_first_generated_token_is_the_argmax_of_lm_head_of_the_vector(
    client: Any, model_name: str, reference: Reference
) -> None:
    for text in ["What is two plus two?", "Is the sky blue?", "Tell me about rivers."]:
        messages = [{"role": "user", "content": text}]
        response = flagged(client, model_name, messages)
        token_ids = response.model_dump()["choices"][0]["token_ids"]
        assert token_ids and token_ids[0] == reference.argmax_next_token(vector_of(response))


def test_concurrent_mixed_requests_each_get_their_own_vector(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    jobs = [
        (i % 2 == 0, f"Request {i}: describe the number {i * 7} and a river.") for i in range(24)
    ]

    def run(job: tuple[bool, str]) -> tuple[bool, str, Any]:
        is_flagged, text = job
        messages: Any = [{"role": "user", "content": text}]
        if is_flagged:
            return is_flagged, text, flagged(client, model_name, messages)
        response = client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=4,
            extra_body=NO_THINKING,
        )
        return is_flagged, text, response

    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) == 24
    for is_flagged, text, response in results:
        messages = [{"role": "user", "content": text}]
        if is_flagged:
            check_against_reference(response, reference, messages, enable_thinking=False)
        else:
            assert response.model_dump().get("kv_transfer_params") is None


def test_flagged_request_with_many_output_tokens(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Count from one to seven."}]
    response = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        extra_body={**NO_THINKING, **FLAG, "return_token_ids": True},
    )
    assert response.usage is not None and response.usage.completion_tokens >= 1
    check_against_reference(response, reference, messages, enable_thinking=False)


@pytest.mark.parametrize("target", ["proxy", "direct"])
def test_ordinary_streaming_equals_non_streaming(
    stack: RunningStack, model_name: str, target: str
) -> None:
    from openai import OpenAI

    url, key = (stack.proxy_url, "unused") if target == "proxy" else (stack.vllm_url, None)
    client = OpenAI(base_url=url + "/v1", api_key=key or stack.vllm_api_key, max_retries=0)
    messages = [{"role": "user", "content": "Stream a few words about mountains."}]
    common: dict[str, Any] = {
        "model": model_name,
        "messages": messages,
        "max_completion_tokens": 16,
        "temperature": 0,
        "extra_body": NO_THINKING,
    }
    whole = client.chat.completions.create(**common)
    chunks = list(client.chat.completions.create(stream=True, **common))
    assert len(chunks) > 2
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert all(
        c.model_extra is None
        or "kv_transfer_params" not in (c.model_extra or {})
        or c.model_extra["kv_transfer_params"] is None
        for c in chunks
    )


def test_proxy_stream_matches_direct_stream(stack: RunningStack, model_name: str) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Stream about colours."}],
        "max_completion_tokens": 12,
        "temperature": 0,
        "stream": True,
        **NO_THINKING,
    }

    def deltas(url: str, headers: dict[str, str]) -> list[str]:
        import json

        path = url + "/v1/chat/completions"
        with httpx.stream("POST", path, json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        return [json.dumps(json.loads(e[6:])["choices"][0]["delta"]) for e in events[:-1]]

    assert deltas(stack.proxy_url, {}) == deltas(stack.vllm_url, stack.vllm_headers)
