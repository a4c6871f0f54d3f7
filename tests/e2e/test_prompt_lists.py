"""A flagged completions prompt list as one vLLM request (issue #46), on real vLLM, against
Transformers.

The hook tells a list's prompts apart by the engine ids vLLM gives them; these tests make the
attribution hard to get right by luck: several lists at once, of many distinct token-id prompts
of different lengths, some repeated and several sharing a long prefix (prefix-cache hits), each
vector checked against Transformers on its own prompt, and closer to its own prompt's reference
than to any other prompt's of its list; the client's hostile ``X-Request-Id`` beside them;
``n = 2`` with ``"last_answer"``; a ``"mean"`` list, one request but for the prompts that hit
another prompt's cached blocks, sent again alone; a ``/v1/chat/completions/batch`` of
conversations; and (own server) vLLM keeping ids unsuffixed
(``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import SHARED_HOOK_ENV, SHARED_LAYERS, RunningStack, require_runner, run_serve
from tests.e2e.stack_probe import COMPLETIONS_HANDLER, metric, vllm_metrics

FLAG = {"return_last_hidden_state": True}
LAYERS = [int(layer) for layer in SHARED_LAYERS]
PREAMBLE = " ".join(f"Shared preamble sentence {i} about rivers and bridges." for i in range(12))
HOSTILE_IDS = ["x-5-deadbeef", "3_y", "cmpl-0-1-00000000"]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def token_prompts(reference: Reference, seed: int) -> list[list[int]]:
    """Distinct prompts of different lengths, one repeated, three sharing a long prefix."""
    tokenize = reference.tokenizer
    shared = list(tokenize(PREAMBLE)["input_ids"])
    own = [
        list(tokenize(f"List {seed} prompt {i}: " + "word " * (i * 3))["input_ids"])
        for i in range(7)
    ]
    tails = [list(tokenize(f" and then ending {seed}-{i}")["input_ids"]) for i in range(3)]
    prompts = [*own[:4], *(shared + tail for tail in tails), *own[4:], own[1], shared + tails[0]]
    assert len({tuple(p) for p in prompts}) == len(prompts) - 2
    assert len({len(p) for p in prompts}) > 5
    return prompts


def check_own_vectors(
    prompts: Sequence[Sequence[int]], vectors: Sequence[Sequence[float]], reference: Reference
) -> None:
    """Each vector matches its own prompt's reference, and no other prompt's better."""
    distinct = {tuple(p): reference.last_hidden_state(p) for p in prompts}
    expected = [distinct[tuple(p)] for p in prompts]
    for index, vector in enumerate(vectors):
        assert_matches(vector, expected[index])
        scores = [cosine(vector, other) for other in expected]
        best = max(range(len(prompts)), key=scores.__getitem__)
        assert tuple(prompts[best]) == tuple(prompts[index]), (index, best)


def post_list(client: Any, model: str, prompts: Any, request_id: str | None = None) -> Any:
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    return client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=2,
        temperature=0,
        extra_headers=headers,
        extra_body={"kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
    )


@pytest.mark.both_runners
def test_concurrent_lists_each_prompt_gets_its_own_vector(
    client: Any, model_name: str, reference: Reference
) -> None:
    lists = [token_prompts(reference, seed) for seed in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(lists)) as pool:
        futures = [
            pool.submit(post_list, client, model_name, prompts, HOSTILE_IDS[i % 3] if i else None)
            for i, prompts in enumerate(lists)
        ]
        responses = [future.result(timeout=600) for future in futures]
    for index, (prompts, response) in enumerate(zip(lists, responses, strict=True)):
        kv = response.model_extra["kv_transfer_params"]
        vectors = kv["last_hidden_states"]
        assert len(vectors) == len(prompts) == len(response.choices)
        check_own_vectors(prompts, vectors, reference)
        infos = kv["last_hidden_state_infos"]
        assert [info["num_prompt_tokens"] for info in infos] == [len(p) for p in prompts]
        if index:  # the reply is named as vLLM would have named it with the client's id
            assert response.id == f"cmpl-{HOSTILE_IDS[index % 3]}"


@pytest.mark.both_runners
def test_a_list_of_strings(client: Any, model_name: str, reference: Reference) -> None:
    texts = [f"String prompt {i}: " + "more " * i for i in range(6)] + [
        "String prompt 2: more more "
    ]
    response = post_list(client, model_name, texts, request_id="3_y")
    vectors = response.model_extra["kv_transfer_params"]["last_hidden_states"]
    ids = [list(reference.tokenizer(text)["input_ids"]) for text in texts]
    check_own_vectors(ids, vectors, reference)


@pytest.mark.both_runners
def test_a_list_with_two_choices_gets_each_answers_state(
    client: Any, model_name: str, reference: Reference
) -> None:
    prompts = token_prompts(reference, 9)[:6]
    response = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=4,
        n=2,
        temperature=1.0,
        extra_body={
            "return_token_ids": True,
            "kv_transfer_params": {
                **FLAG,
                "last_hidden_state_pooling": "last_answer",
                "last_hidden_state_layers": LAYERS,
                "last_hidden_state_info": True,
            },
        },
    )
    kv = response.model_extra["kv_transfer_params"]
    per_choice = list(
        zip(kv["last_hidden_states_by_layer"], kv["last_hidden_state_infos"], strict=True)
    )
    assert len(per_choice) == len(response.choices) == 2 * len(prompts)
    for choice, (by_layer, info) in zip(response.choices, per_choice, strict=True):
        prompt = prompts[choice.index // 2]
        answer = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == prompt
        ids = [*prompt, *answer[:-1]]
        assert info["num_prompt_tokens"] == len(prompt)
        assert info["position"] == len(ids) - 1
        for label, vector in by_layer.items():
            expected = reference.layer_vector(ids, int(label), "last")
            assert_matches(vector, expected, f"layer {label}, last_answer")


#: vLLM's KV cache block on the CPU (its default there): a prefix-cache hit is whole blocks.
CPU_BLOCK = 128


@pytest.mark.both_runners
def test_a_mean_list_is_one_request_and_a_prompt_served_from_the_cache_goes_alone(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    """A ``"mean"`` list goes as one request under one ``cache_salt``; its prompts that share
    more than a block with an earlier one (a repeat, a long shared preamble) are served those
    blocks from the cache, and the hook cannot average them: the proxy sends each again alone.
    Every prompt's mean, on two layers, is Transformers' for its own tokens."""
    tokenize = reference.tokenizer
    preamble = list(tokenize(PREAMBLE * 3)["input_ids"])
    assert len(preamble) > 2 * CPU_BLOCK
    own = [list(tokenize(f"Mean prompt {i}: " + "word " * (i * 5))["input_ids"]) for i in range(4)]
    tails = [list(tokenize(f" and the mean ends {i}")["input_ids"]) for i in range(2)]
    prompts = [own[0], preamble + tails[0], own[1], preamble + tails[1], own[2], preamble]
    prompts += [own[3], own[1], preamble + tails[0]]
    # What one request adds to vLLM's HTTP counter.
    counted = metric(vllm_metrics(stack), "http_requests_total", COMPLETIONS_HANDLER)
    client.completions.create(model=model_name, prompt=own[0], max_tokens=1)
    sent_before = metric(vllm_metrics(stack), "http_requests_total", COMPLETIONS_HANDLER)
    one_request = sent_before - counted
    response = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=2,
        temperature=0,
        extra_body={
            "kv_transfer_params": {
                **FLAG,
                "last_hidden_state_pooling": "mean",
                "last_hidden_state_layers": [0, -1],
                "last_hidden_state_info": True,
            }
        },
    )
    sent = metric(vllm_metrics(stack), "http_requests_total", COMPLETIONS_HANDLER) - sent_before
    kv = response.model_extra["kv_transfer_params"]
    assert len(kv["last_hidden_states_by_layer"]) == len(prompts) == len(response.choices)
    for index, (prompt, by_layer, info) in enumerate(
        zip(prompts, kv["last_hidden_states_by_layer"], kv["last_hidden_state_infos"], strict=True)
    ):
        assert info["num_prompt_tokens"] == len(prompt) and info["pooling"] == "mean"
        for label, vector in by_layer.items():
            expected = reference.layer_vector(prompt, int(label), "mean")
            assert_matches(vector, expected, f"prompt {index}, layer {label}, mean")
    alone = round(sent / one_request) - 1
    print(f"\nmean list of {len(prompts)} prompts: 1 request, {alone} prompt(s) sent again alone")
    # The preamble's three later copies (more than two blocks each) hit the first's blocks; a
    # repeat of a short prompt fills no block, so hits nothing.
    assert one_request > 0 and 1 <= alone <= 3, (sent, one_request)


@pytest.fixture(scope="module")
def unsuffixed_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    layers = ["--hidden-state-layers", ",".join(SHARED_LAYERS)]
    env = {**SHARED_HOOK_ENV, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
    with run_serve(tiny_model_dir, tmp_path_factory.mktemp("unsuffixed"), layers, env) as stack:
        require_runner(stack, "v1")
        yield stack


@pytest.mark.own_server
def test_lists_where_vllm_keeps_ids_unsuffixed(
    unsuffixed_stack: RunningStack, reference: Reference
) -> None:
    from openai import OpenAI

    with OpenAI(
        base_url=unsuffixed_stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        model = client.models.list().data[0].id
        lists = [token_prompts(reference, seed) for seed in range(2)]
        with concurrent.futures.ThreadPoolExecutor(len(lists)) as pool:
            # The same client id on both: vLLM would run both lists' prompts under one id.
            futures = [pool.submit(post_list, client, model, p, "same") for p in lists]
            responses = [future.result(timeout=600) for future in futures]
    for prompts, response in zip(lists, responses, strict=True):
        vectors = response.model_extra["kv_transfer_params"]["last_hidden_states"]
        check_own_vectors(prompts, vectors, reference)


@pytest.mark.both_runners
def test_a_chat_batch_gets_each_conversations_vector(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    import httpx

    conversations = [
        [{"role": "user", "content": f"Batch question {i}: " + "why " * (i * 2)}] for i in range(6)
    ]
    conversations += [conversations[3], [{"role": "user", "content": PREAMBLE}]]
    body = {
        "model": model_name,
        "messages": conversations,
        "max_tokens": 2,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        "kv_transfer_params": {**FLAG, "last_hidden_state_info": True},
    }
    unflagged = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    with httpx.Client(base_url=stack.proxy_url, timeout=300, trust_env=False) as client:
        response = client.post(
            "/v1/chat/completions/batch", json=body, headers={"X-Request-Id": "3_y"}
        )
        ordinary = client.post("/v1/chat/completions/batch", json=unflagged)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "chatcmpl-3_y"
    vectors = answer["kv_transfer_params"]["last_hidden_states"]
    ids = [reference.chat_token_ids(c, enable_thinking=False) for c in conversations]
    check_own_vectors(ids, vectors, reference)
    assert ordinary.status_code == 200, ordinary.text
    assert len(ordinary.json()["choices"]) == len(conversations)
    assert "kv_transfer_params" not in ordinary.json() or not ordinary.json()["kv_transfer_params"]
