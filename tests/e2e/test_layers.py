"""Chosen layers and mean pooling (issue #14) on real vLLM, every vector against Transformers.

The shared stack captures layers 0, 1 and -1 of the two-layer tiny model
(``SHARED_LAYERS``): the embeddings, the residual stream after the first decoder layer, and the
final layer after the final norm. Its batches hold 128 tokens, so a long prompt is prefilled in
several chunks, and it caches prefixes.
"""

from __future__ import annotations

import base64
import concurrent.futures
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS, SHARED_LAYERS, RunningStack
from tests.e2e.stack_probe import prefix_cache_hits

#: Run on V1 and again on V2 (HSP_E2E_RUNNER=v2): what V2 changes (tests/e2e/server.py).
pytestmark = pytest.mark.both_runners

LAYERS = [int(layer) for layer in SHARED_LAYERS]
LONG_TEXT = " ".join(
    f"Layer sentence {i} describes a harbour, a lighthouse and the colour {c}."
    for i, c in enumerate(["amber", "teal", "crimson", "ivory", "olive", "slate"] * 3)
)
CHAT = "/v1/chat/completions"


def ask(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    *,
    layers: list[int] | None = LAYERS,
    pooling: str = "last",
    **extra: Any,
) -> dict[str, Any]:
    kv: dict[str, Any] = {"return_last_hidden_state": True, "last_hidden_state_info": True}
    if layers is not None:
        kv["last_hidden_state_layers"] = layers
    if pooling != "last":
        kv["last_hidden_state_pooling"] = pooling
    body = {**NO_THINKING, "kv_transfer_params": kv, "return_token_ids": True, **extra}
    response = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=1, temperature=0, extra_body=body
    )
    dumped: dict[str, Any] = response.model_dump()
    return dumped


def check_layers(
    answer: dict[str, Any],
    reference: Reference,
    ids: list[int],
    pooling: str,
    layers: list[int] = LAYERS,
) -> dict[str, list[float]]:
    """Every requested layer's vector against Transformers; returns them by label."""
    kv = answer["kv_transfer_params"]
    by_layer: dict[str, list[float]] = kv["last_hidden_states_by_layer"]
    assert list(by_layer) == [str(layer) for layer in layers]
    for label, vector in by_layer.items():
        assert_matches(
            vector,
            reference.layer_vector(ids, int(label), pooling),
            f"layer {label}, {pooling}",
        )
    info = kv["last_hidden_state_info"]
    assert info["layers"] == layers and info["pooling"] == pooling
    assert info["num_prompt_tokens"] == len(ids)
    return by_layer


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_short_prompt_every_layer_and_pooling(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    messages = [{"role": "user", "content": f"Short prompt for {pooling} pooling."}]
    answer = ask(client, model_name, messages, pooling=pooling)
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert answer["prompt_token_ids"] == ids
    by_layer = check_layers(answer, reference, ids, pooling)
    # The final layer is last_hidden_state, bit for bit.
    assert answer["kv_transfer_params"]["last_hidden_state"] == by_layer["-1"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_assistant_prefill(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    messages = [
        {"role": "user", "content": "Name a colour of the sea."},
        {"role": "assistant", "content": "The colour of the sea is"},
    ]
    template: dict[str, Any] = {"continue_final_message": True, "add_generation_prompt": False}
    answer = ask(client, model_name, messages, pooling=pooling, **template)
    ids = reference.chat_token_ids(messages, enable_thinking=False, **template)
    assert answer["prompt_token_ids"] == ids
    check_layers(answer, reference, ids, pooling)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prompt_chunked_over_several_prefill_steps(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    messages = [{"role": "user", "content": f"Chunked {pooling}: {LONG_TEXT}"}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS, "the prompt must span several prefill chunks"
    check_layers(ask(client, model_name, messages, pooling=pooling), reference, ids, pooling)


def test_a_shared_long_prefix_hits_the_cache_for_last_and_is_recomputed_for_mean(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    first = [{"role": "user", "content": f"Shared prefix. {LONG_TEXT} Question one?"}]
    second = [{"role": "user", "content": f"Shared prefix. {LONG_TEXT} Question two, longer?"}]
    ask(client, model_name, first)  # fills the prefix cache
    ids = reference.chat_token_ids(second, enable_thinking=False)

    hits = prefix_cache_hits(stack)
    answer = ask(client, model_name, second)
    assert prefix_cache_hits(stack) > hits, "the second prompt should hit the prefix cache"
    check_layers(answer, reference, ids, "last")

    # Mean pooling must see every position: the proxy's fresh cache_salt keeps the cache out.
    hits = prefix_cache_hits(stack)
    answer = ask(client, model_name, second, pooling="mean")
    assert prefix_cache_hits(stack) == hits, "a mean request read the prefix cache"
    check_layers(answer, reference, ids, "mean")


def test_concurrent_mixed_requests_each_get_their_own_layers(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cases = []
    for i in range(24):
        text = f"Concurrent {i}: " + ("a harbour at dusk " * (1 + i % 9))
        layers = [[0], [1, -1], [0, 1]][i % 3]
        cases.append(([{"role": "user", "content": text}], layers, "mean" if i % 2 else "last"))

    def one(case: tuple[list[dict[str, Any]], list[int], str]) -> None:
        messages, layers, pooling = case
        answer = ask(client, model_name, messages, layers=layers, pooling=pooling)
        ids = reference.chat_token_ids(messages, enable_thinking=False)
        check_layers(answer, reference, ids, pooling, layers)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        list(pool.map(one, cases))


def test_the_final_layer_equals_todays_vector_bit_for_bit(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Final layer, exactly as before."}]
    plain = ask(client, model_name, messages, layers=None)
    layered = ask(client, model_name, messages, layers=[2, 0])
    kv_plain, kv_layered = plain["kv_transfer_params"], layered["kv_transfer_params"]
    assert "last_hidden_states_by_layer" not in kv_plain
    assert kv_plain["last_hidden_state_info"]["layer"] == "final_norm"
    assert kv_layered["last_hidden_state"] == kv_plain["last_hidden_state"]
    assert kv_layered["last_hidden_states_by_layer"]["2"] == kv_plain["last_hidden_state"]
    # Without the final layer asked for, the singular field is absent.
    only_first = ask(client, model_name, messages, layers=[1])["kv_transfer_params"]
    assert "last_hidden_state" not in only_first and list(
        only_first["last_hidden_states_by_layer"]
    ) == ["1"]


def test_streaming_n3_and_base64_with_layers(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Stream the layers, three times."}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    kv = {
        "return_last_hidden_state": True,
        "last_hidden_state_layers": [1, -1],
        "last_hidden_state_pooling": "mean",
        "last_hidden_state_format": "base64",
    }
    stream: Any = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=3,
        n=3,
        stream=True,
        extra_body={**NO_THINKING, "kv_transfer_params": kv},
    )
    found: list[Any] = [
        (chunk.model_extra or {}).get("kv_transfer_params")
        for chunk in stream
        if (chunk.model_extra or {}).get("kv_transfer_params")
    ]
    assert len(found) == 1, "the vectors ride on the first choice chunk only"
    for label, encoded in found[0]["last_hidden_states_by_layer"].items():
        vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist()
        assert_matches(
            vector,
            reference.layer_vector(ids, int(label), "mean"),
            f"layer {label}, mean",
        )


def test_completions_prompt_list_gets_one_object_per_prompt(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    prompts = ["First completion prompt.", "Second one, a little longer than the first."]
    body = {
        "model": model_name,
        "prompt": prompts,
        "max_tokens": 1,
        "kv_transfer_params": {
            "return_last_hidden_state": True,
            "last_hidden_state_layers": [0, 1],
            "last_hidden_state_pooling": "mean",
        },
    }
    response = httpx.post(stack.proxy_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    objects = response.json()["kv_transfer_params"]["last_hidden_states_by_layer"]
    assert len(objects) == len(prompts)
    for prompt, by_layer in zip(prompts, objects, strict=True):
        ids = reference.tokenizer(prompt)["input_ids"]
        for label, vector in by_layer.items():
            assert_matches(
                vector,
                reference.layer_vector(ids, int(label), "mean"),
                f"layer {label}, mean",
            )


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_layer_and_pooling(
    stack: RunningStack, model_name: str, reference: Reference, pooling: str
) -> None:
    from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE

    text = "An embedding from the first layer."
    body = {
        "model": model_name,
        "input": [text],
        "layer": 1,
        "pooling": pooling,
        "normalize": False,
    }
    response = httpx.post(stack.proxy_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 200, response.text
    messages = [{"role": "user", "content": DEFAULT_TEMPLATE.replace("{text}", text)}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert_matches(
        response.json()["data"][0]["embedding"],
        reference.layer_vector(ids, 1, pooling),
        f"layer 1, {pooling}",
    )


@pytest.mark.parametrize(
    ("kv", "param", "says"),
    [
        ({"last_hidden_state_layers": [7]}, "last_hidden_state_layers", "captures layers 0, 1, 2"),
        ({"last_hidden_state_layers": [-4]}, "last_hidden_state_layers", "captures layers"),
        ({"last_hidden_state_layers": "1"}, "last_hidden_state_layers", "list of layer indices"),
        ({"last_hidden_state_layers": []}, "last_hidden_state_layers", "non-empty"),
        ({"last_hidden_state_layers": [True]}, "last_hidden_state_layers", "integers"),
        ({"last_hidden_state_pooling": "max"}, "last_hidden_state_pooling", "last, mean"),
    ],
)
def test_bad_layers_or_pooling_is_a_400_naming_the_field(
    stack: RunningStack, model_name: str, kv: dict[str, Any], param: str, says: str
) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "bad"}],
        "kv_transfer_params": {"return_last_hidden_state": True, **kv},
    }
    response = httpx.post(stack.proxy_url + CHAT, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"kv_transfer_params.{param}" and says in error["message"]


def test_a_generated_answers_representation_is_one_flagged_follow_up_away(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    """README recipe: the state after the answer's last token, for probes on answers."""
    conversation = [{"role": "user", "content": f"Answer briefly about {LONG_TEXT[:300]}"}]
    first = client.chat.completions.create(
        model=model_name,
        messages=conversation,
        max_completion_tokens=12,
        temperature=0,
        extra_body=NO_THINKING,
    )
    answer = first.choices[0].message.content
    assert answer
    # --- the recipe, as in the README ---
    hits = prefix_cache_hits(stack)
    follow_up = client.chat.completions.create(
        model=model_name,
        messages=[*conversation, {"role": "assistant", "content": answer}],
        max_completion_tokens=1,
        extra_body={
            **NO_THINKING,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "kv_transfer_params": {
                "return_last_hidden_state": True,
                "last_hidden_state_layers": [1, -1],
            },
        },
    )
    by_layer = follow_up.model_dump()["kv_transfer_params"]["last_hidden_states_by_layer"]
    # ---
    assert prefix_cache_hits(stack) > hits, "the follow-up should reuse the cached prompt"
    ids = reference.chat_token_ids(
        [*conversation, {"role": "assistant", "content": answer}],
        enable_thinking=False,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    for label, vector in by_layer.items():
        assert_matches(
            vector,
            reference.layer_vector(ids, int(label), "last"),
            f"layer {label}, last",
        )
