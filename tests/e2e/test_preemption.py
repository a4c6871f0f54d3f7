"""Requests preempted and resumed keep their vectors, on model runner V1 and V2 (issue #35),
and so does each prompt of a list sent as one vLLM request (issue #46).

A server whose KV cache holds one request of its full length (``--max-model-len 256``, nine
blocks of 32 tokens, one of them vLLM's null block) gets four flagged chats at once, each
writing 180 tokens (``ignore_eos``): the scheduler must preempt some and resume them later.
V1 resumes a preempted request where it stopped; V2 resumes it as a new request, recomputing
its prompt and answer so far. Each request asks for a different kind of state (the prompt's
last and mean, the answer's state, every answer position), and every vector and row is
checked against Transformers; ``vllm:num_preemptions_total`` proves the preemption happened
(the chats start together, past a barrier; a round that still preempts nothing, its chats not
overlapping on a loaded machine, is followed by another, up to ``MAX_ROUNDS``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import COUNTED, Reference, assert_matches
from tests.e2e.server import (
    RUNNERS,
    SHARED_HOOK_ENV,
    SHARED_LAYERS,
    RunningStack,
    require_runner,
    run_serve,
)
from tests.e2e.stack_probe import COMPLETIONS_HANDLER, metric, vllm_metrics
from tests.e2e.test_matrices import check_answer

pytestmark = pytest.mark.own_server

SMALL_CACHE = [
    "--max-model-len",
    "256",
    "--block-size",
    "32",
    "--num-gpu-blocks-override",
    "9",
    "--hidden-state-layers",
    ",".join(SHARED_LAYERS),
]
ANSWER_TOKENS = 180
#: Rounds of four concurrent chats at most, until vLLM has preempted one: a round whose chats
#: happen not to overlap (a loaded machine starting one thread late) preempts nothing.
MAX_ROUNDS = 4
LAYERS = [int(layer) for layer in SHARED_LAYERS]


@pytest.fixture(scope="module", params=RUNNERS)
def small_cache_stack(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, RunningStack]]:
    runner: str = request.param
    work = tmp_path_factory.mktemp(f"preemption-{runner}")
    with run_serve(tiny_model_dir, work, SMALL_CACHE, SHARED_HOOK_ENV, runner=runner) as stack:
        require_runner(stack, runner)
        yield runner, stack


def long_chat(
    stack: RunningStack, start: threading.Barrier, index: int, pooling: str
) -> dict[str, Any]:
    """One flagged chat, sent once every thread of the round is ready to send its own."""
    from openai import OpenAI

    with OpenAI(
        base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        model = client.models.list().data[0].id
        start.wait(timeout=120)
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Story {index}: " + "a river " * (8 + index)}],
            max_completion_tokens=ANSWER_TOKENS,
            temperature=0,
            extra_body={
                **NO_THINKING,
                "ignore_eos": True,
                "return_token_ids": True,
                "kv_transfer_params": {
                    "return_last_hidden_state": True,
                    "last_hidden_state_pooling": pooling,
                    "last_hidden_state_layers": LAYERS,
                    "last_hidden_state_info": True,
                },
            },
        )
    answer: dict[str, Any] = response.model_dump()
    return answer


def check_prompt_state(reference: Reference, answer: dict[str, Any], pooling: str) -> None:
    prompt_ids = answer["prompt_token_ids"]
    for label, vector in answer["kv_transfer_params"]["last_hidden_states_by_layer"].items():
        expected = reference.layer_vector(prompt_ids, int(label), pooling)
        assert_matches(vector, expected, f"layer {label}, {pooling} (preempted)")


def check_answer_state(reference: Reference, answer: dict[str, Any], pooling: str) -> None:
    prompt_ids, answer_ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    assert len(answer_ids) == ANSWER_TOKENS
    params = answer["kv_transfer_params"]
    if pooling == "all_answer":
        check_answer(
            reference,
            prompt_ids,
            answer_ids,
            params["last_hidden_states_by_layer"],
            params["last_hidden_state_info"],
        )
        return
    ids = [*prompt_ids, *answer_ids[:-1]]
    for label, vector in params["last_hidden_states_by_layer"].items():
        expected = reference.layer_vector(ids, int(label), "last")
        assert_matches(vector, expected, f"layer {label}, last_answer (preempted)")


CHECKS: dict[str, Callable[[Reference, dict[str, Any], str], None]] = {
    "last": check_prompt_state,
    "mean": check_prompt_state,
    "last_answer": check_answer_state,
    "all_answer": check_answer_state,
}


def one_round(stack: RunningStack, reference: Reference) -> float:
    """Four flagged chats at once, one per kind of state, each checked; vLLM's preemptions
    meanwhile."""
    poolings = list(CHECKS)
    before = metric(vllm_metrics(stack), "vllm:num_preemptions_total")
    start = threading.Barrier(len(poolings))
    with concurrent.futures.ThreadPoolExecutor(len(poolings)) as pool:
        answers = list(pool.map(lambda job: long_chat(stack, start, *job), enumerate(poolings)))
    for pooling, answer in zip(poolings, answers, strict=True):
        CHECKS[pooling](reference, answer, pooling)
    return metric(vllm_metrics(stack), "vllm:num_preemptions_total") - before


def test_preempted_and_resumed_requests_keep_their_vectors(
    small_cache_stack: tuple[str, RunningStack], reference: Reference
) -> None:
    runner, stack = small_cache_stack
    rounds, preemptions = 1, one_round(stack, reference)
    while preemptions == 0 and rounds < MAX_ROUNDS:
        rounds, preemptions = rounds + 1, one_round(stack, reference)
    assert preemptions > 0, (
        f"the small cache should have made vLLM preempt a request ({rounds} rounds)"
    )
    COUNTED.append(
        f"preemption ({runner}): {len(CHECKS)} concurrent flagged 180-token chats, "
        f"{rounds} round(s), "
        f"{preemptions:.0f} preemptions, every vector and row equal to Transformers'"
    )


#: A prompt list sent as one vLLM request (issue #46) through the small cache: prompts of
#: different lengths, some repeated, a long shared prefix among some (prefix-cache hits), more
#: than the cache holds at once, so vLLM queues and preempts prompts of the same request.
LIST_SIZE = 64
LIST_ANSWER_TOKENS = 16


def list_prompts(reference: Reference, round_: int) -> list[list[int]]:
    tokenize = reference.tokenizer
    shared = list(
        tokenize(" ".join(f"Preamble {i} of the long list." for i in range(5)))["input_ids"]
    )
    prompts: list[list[int]] = []
    for i in range(LIST_SIZE):
        if i % 8 == 7:
            prompts.append(prompts[i - 3])  # repeated
        elif i % 8 == 3:
            prompts.append(shared + list(tokenize(f" ending {round_}-{i}")["input_ids"]))
        else:
            text = f"Round {round_} prompt {i}: " + "word " * (i % 11)
            prompts.append(list(tokenize(text)["input_ids"]))
    return prompts


def list_round(stack: RunningStack, reference: Reference, round_: int) -> float:
    """One list of ``LIST_SIZE`` token-id prompts (pooling last) and, at once, a list of 6 with
    ``n = 2`` and ``last_answer``; every vector checked against its own prompt's reference (and
    closer to it than to any other prompt's); vLLM's preemptions meanwhile."""
    from openai import OpenAI

    prompts = list_prompts(reference, round_)
    answered = prompts[:6]
    flag = {"return_last_hidden_state": True, "last_hidden_state_info": True}
    with OpenAI(
        base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        model = client.models.list().data[0].id
        # What one request to vLLM adds to its HTTP counter (the count the lists are held to).
        counted = metric(vllm_metrics(stack), "http_requests_total", COMPLETIONS_HANDLER)
        client.completions.create(model=model, prompt=prompts[0], max_tokens=1)
        text = vllm_metrics(stack)
        sent_before = metric(text, "http_requests_total", COMPLETIONS_HANDLER)
        one_request = sent_before - counted
        before = metric(text, "vllm:num_preemptions_total")

        def send(prompt: list[list[int]], n: int, pooling: str) -> Any:
            return client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=LIST_ANSWER_TOKENS,
                n=n,
                temperature=0 if n == 1 else 1.0,
                extra_body={
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "kv_transfer_params": {**flag, "last_hidden_state_pooling": pooling},
                },
            )

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            last = pool.submit(send, prompts, 1, "last")
            answers = pool.submit(send, answered, 2, "last_answer")
            last_reply, answer_reply = last.result(timeout=1200), answers.result(timeout=1200)
    text = vllm_metrics(stack)
    preemptions = metric(text, "vllm:num_preemptions_total") - before
    # Each list was one request to vLLM, not one a prompt.
    sent = metric(text, "http_requests_total", COMPLETIONS_HANDLER) - sent_before
    assert one_request > 0 and sent == 2 * one_request, (sent, one_request)

    vectors = last_reply.model_extra["kv_transfer_params"]["last_hidden_states"]
    assert len(vectors) == len(prompts) == len(last_reply.choices)
    expected = [reference.last_hidden_state(p) for p in prompts]
    for index, vector in enumerate(vectors):
        assert_matches(vector, expected[index], f"prompt {index} of a preempted list")
        distances = [sum((a - b) ** 2 for a, b in zip(vector, e, strict=True)) for e in expected]
        nearest = min(range(len(prompts)), key=distances.__getitem__)
        assert prompts[nearest] == prompts[index], (index, nearest)

    kv = answer_reply.model_extra["kv_transfer_params"]
    assert len(kv["last_hidden_states"]) == len(answer_reply.choices) == 2 * len(answered)
    for choice, vector, info in zip(
        answer_reply.choices, kv["last_hidden_states"], kv["last_hidden_state_infos"], strict=True
    ):
        prompt = answered[choice.index // 2]
        assert choice.model_extra["prompt_token_ids"] == prompt
        answer_ids = choice.model_extra["token_ids"]
        assert len(answer_ids) == LIST_ANSWER_TOKENS
        assert info["num_prompt_tokens"] == len(prompt)
        expected_answer = reference.last_hidden_state([*prompt, *answer_ids[:-1]])
        assert_matches(vector, expected_answer, f"choice {choice.index}, last_answer (list)")
    return preemptions


def test_a_preempted_list_keeps_each_prompts_vector(
    small_cache_stack: tuple[str, RunningStack], reference: Reference
) -> None:
    runner, stack = small_cache_stack
    rounds, preemptions = 1, list_round(stack, reference, 0)
    while preemptions == 0 and rounds < MAX_ROUNDS:
        rounds, preemptions = rounds + 1, list_round(stack, reference, rounds)
    assert preemptions > 0, f"the list should have made vLLM preempt a prompt ({rounds} rounds)"
    COUNTED.append(
        f"preemption ({runner}): a list of {LIST_SIZE} token-id prompts as one request beside a "
        f"list of 6 with n = 2 (last_answer), {rounds} round(s), {preemptions:.0f} preemptions, "
        "every vector its own prompt's"
    )
