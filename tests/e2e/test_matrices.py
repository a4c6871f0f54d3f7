"""Matrices (poolings "all_prompt" and "all_answer", issue #28) on real vLLM, against
Transformers: every row of every captured layer (0, 1, -1), for short prompts, prompts chunked
over several prefill steps and prompts whose prefix is in the cache, as JSON with one and two
choices and as a stream; 16-bit dtypes, lists of rows, the limits, concurrency.

- ``"all_prompt"``: Transformers' ``hidden_states[layer][0]``, every prompt position.
- ``"all_answer"``: per choice, the states that chose each of its ``C`` tokens: positions
  ``P - 1 .. P + C - 2`` of Transformers' run on prompt + answer minus its last token.

No request sets a ``seed`` (see test_answer_vectors.py).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import numpy.typing as npt
import openai
import pytest

from tests.e2e.chat_requests import NO_THINKING, beside_ordinary_traffic
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS, MAX_RECORD_MIB, SHARED_LAYERS, RunningStack
from tests.e2e.stack_probe import prefix_cache_hits
from vllm_hidden_state_proxy.protocol import MAX_RECORD_MIB_ENV

#: Run on V1 and again on V2 (HSP_E2E_RUNNER=v2): what V2 changes (tests/e2e/server.py).
pytestmark = pytest.mark.both_runners

LAYERS = [int(layer) for layer in SHARED_LAYERS]
LONG_TEXT = " ".join(
    f"Matrix sentence {i} names a harbour, a lantern and the number {i * 3}." for i in range(9)
)
PROMPTS = {
    "short": "Describe a small harbour.",
    "chunked": f"Summarise: {LONG_TEXT}",
    "prefix_hit": f"Cached prefix. {LONG_TEXT} Which lantern?",
}
Rows = npt.NDArray[np.float32]


def decode(matrix: dict[str, Any], hidden_size: int) -> Rows:
    """A matrix object's rows as float32 (from base64 of any dtype, or from lists)."""
    rows, width = matrix["shape"]
    assert width == hidden_size
    data = matrix["data"]
    if isinstance(data, list):
        assert matrix["dtype"] == "float32"
        return np.asarray(data, dtype=np.float32).reshape(rows, width)
    raw = base64.b64decode(data)
    if matrix["dtype"] == "float16":
        values = np.frombuffer(raw, "<f2").astype(np.float32)
    elif matrix["dtype"] == "bfloat16":
        values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        assert matrix["dtype"] == "float32"
        values = np.frombuffer(raw, "<f4").astype(np.float32)
    return values.reshape(rows, width)


def kv(pooling: str, **extra: Any) -> dict[str, Any]:
    return {
        "return_last_hidden_state": True,
        "last_hidden_state_pooling": pooling,
        "last_hidden_state_layers": LAYERS,
        "last_hidden_state_info": True,
        **extra,
    }


def check_rows(
    reference: Reference,
    ids: list[int],
    first: int,
    by_layer: dict[str, dict[str, Any]],
    kind: str,
) -> None:
    """Each layer's rows against Transformers' rows ``first ..`` of its run on ``ids``."""
    assert list(by_layer) == [str(layer) for layer in LAYERS]
    for label, matrix in by_layer.items():
        rows = decode(matrix, reference.hidden_size)
        expected = reference.layer_rows(ids, int(label))[first:]
        assert len(rows) == len(expected), (len(rows), len(expected))
        for row, want in zip(rows, expected, strict=True):
            assert_matches(row.tolist(), want, f"layer {label}, {kind}")


def check_prompt(reference: Reference, prompt_ids: list[int], params: dict[str, Any]) -> None:
    info = params["last_hidden_state_info"]
    assert (info["pooling"], info["position"]) == ("all_prompt", 0)
    assert info["rows"] == info["num_prompt_tokens"] == len(prompt_ids)
    assert params["last_hidden_state"] == params["last_hidden_states_by_layer"]["-1"]
    check_rows(reference, prompt_ids, 0, params["last_hidden_states_by_layer"], "all_prompt")


def check_answer(
    reference: Reference,
    prompt_ids: list[int],
    answer_ids: list[int],
    by_layer: dict[str, dict[str, Any]],
    info: dict[str, Any],
) -> None:
    assert info["pooling"] == "all_answer"
    assert info["num_prompt_tokens"] == len(prompt_ids) == info["position"] + 1
    assert info["rows"] == info["num_output_tokens"] == len(answer_ids)
    ids = [*prompt_ids, *answer_ids[:-1]]
    check_rows(reference, ids, len(prompt_ids) - 1, by_layer, "all_answer")


def request(
    client: Any, model: str, content: str, pooling: str, n: int = 1, **extra: Any
) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": 1.0} if n > 1 else {"temperature": 0}
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        n=n,
        extra_body={**NO_THINKING, "kv_transfer_params": kv(pooling), "return_token_ids": True},
        **{"max_completion_tokens": 5, **sampling, **extra},
    )
    dumped: dict[str, Any] = response.model_dump()
    return dumped


def warm(stack: RunningStack, client: Any, model: str, prompt: str, content: str) -> None:
    """For the prefix-hit case: an ordinary request puts the prompt's prefix in the cache (a
    second one hits it, which proves it)."""
    if prompt != "prefix_hit":
        return
    for variant in ("", " Again?"):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content + variant}],
            max_completion_tokens=2,
            extra_body=NO_THINKING,
        )
        if not variant:
            hits = prefix_cache_hits(stack)
    assert prefix_cache_hits(stack) > hits, "the prompt's prefix should be in the cache"


def stream_events(
    client: Any, model: str, content: str, pooling: str
) -> tuple[list[int], dict[int, list[int]], list[tuple[int | None, dict[str, Any]]]]:
    """A two-choice stream: the prompt ids, each choice's ids, and every chunk's vectors (with
    the index of the choice of the chunk that carried them)."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_completion_tokens=4,
        n=2,
        temperature=1.0,
        stream=True,
        extra_body={**NO_THINKING, "kv_transfer_params": kv(pooling), "return_token_ids": True},
    )
    prompt_ids: list[int] = []
    answers: dict[int, list[int]] = {0: [], 1: []}
    carried: list[tuple[int | None, dict[str, Any]]] = []
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            answers[choice.index] += (choice.model_extra or {}).get("token_ids") or []
        params = extra.get("kv_transfer_params")
        if params is not None:
            finished = [c.index for c in chunk.choices if c.finish_reason is not None]
            carried.append((finished[0] if finished else None, params))
    return prompt_ids, answers, carried


def chunked_check(reference: Reference, prompt: str, content: str) -> None:
    if prompt == "chunked":
        ids = reference.chat_token_ids(
            [{"role": "user", "content": content}], enable_thinking=False
        )
        assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS, "the prompt must span several chunks"


@pytest.mark.parametrize("mode", ["json", "n2", "stream"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_all_prompt_rows_are_transformers_rows(
    stack: RunningStack,
    client: Any,
    model_name: str,
    reference: Reference,
    prompt: str,
    mode: str,
) -> None:
    content = f"{PROMPTS[prompt]} (all_prompt, {mode})"
    chunked_check(reference, prompt, content)
    warm(stack, client, model_name, prompt, content)
    if mode == "stream":
        prompt_ids, _, carried = stream_events(client, model_name, content, "all_prompt")
        assert len(carried) == 1, "the prompt's rows ride on one chunk"
        check_prompt(reference, prompt_ids, carried[0][1])
        return
    answer = request(client, model_name, content, "all_prompt", n=2 if mode == "n2" else 1)
    check_prompt(reference, answer["prompt_token_ids"], answer["kv_transfer_params"])


@pytest.mark.parametrize("mode", ["json", "n2", "stream"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_all_answer_rows_are_the_states_that_chose_each_token(
    stack: RunningStack,
    client: Any,
    model_name: str,
    reference: Reference,
    prompt: str,
    mode: str,
) -> None:
    content = f"{PROMPTS[prompt]} (all_answer, {mode})"
    chunked_check(reference, prompt, content)
    warm(stack, client, model_name, prompt, content)
    if mode == "stream":
        prompt_ids, answers, carried = stream_events(client, model_name, content, "all_answer")
        assert sorted(index for index, _ in carried if index is not None) == [0, 1]
        assert len(carried) == 2
        for index, params in carried:
            assert index is not None
            check_answer(
                reference,
                prompt_ids,
                answers[index],
                params["last_hidden_states_by_layer"],
                params["last_hidden_state_info"],
            )
        return
    n = 2 if mode == "n2" else 1
    answer = request(client, model_name, content, "all_answer", n=n)
    params = answer["kv_transfer_params"]
    if n == 1:
        per_choice = [(params["last_hidden_states_by_layer"], params["last_hidden_state_info"])]
    else:
        per_choice = list(
            zip(
                params["last_hidden_states_by_layer"],
                params["last_hidden_state_infos"],
                strict=True,
            )
        )
    assert len(per_choice) == n == len(answer["choices"])
    for choice, (by_layer, info) in zip(answer["choices"], per_choice, strict=True):
        check_answer(reference, answer["prompt_token_ids"], choice["token_ids"], by_layer, info)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_dtypes_are_the_float32_rows_rounded(
    client: Any, model_name: str, reference: Reference, dtype: str
) -> None:
    content = "Round these rows."
    exact = request(client, model_name, content, "all_prompt", max_completion_tokens=1)
    rounded = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": content}],
        max_completion_tokens=1,
        extra_body={
            **NO_THINKING,
            "kv_transfer_params": kv("all_prompt", last_hidden_state_dtype=dtype),
        },
    ).model_dump()["kv_transfer_params"]
    assert rounded["last_hidden_state_info"]["dtype"] == dtype
    for label in map(str, LAYERS):
        want = decode(exact["kv_transfer_params"]["last_hidden_states_by_layer"][label], 128)
        got = decode(rounded["last_hidden_states_by_layer"][label], reference.hidden_size)
        assert rounded["last_hidden_states_by_layer"][label]["dtype"] == dtype
        if dtype == "float16":
            assert np.array_equal(got, want.astype(np.float16).astype(np.float32))
        else:  # within bfloat16's half an ulp: 2**-8 of the value
            assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-8)


def test_lists_of_rows_on_request(client: Any, model_name: str, reference: Reference) -> None:
    answer = client.completions.create(
        model=model_name,
        prompt="Lists of rows",
        max_tokens=2,
        extra_body={
            "kv_transfer_params": kv("all_prompt", last_hidden_state_format="float"),
            "return_token_ids": True,
        },
    ).model_dump()
    params = answer["kv_transfer_params"]
    matrix = params["last_hidden_state"]
    assert isinstance(matrix["data"], list) and isinstance(matrix["data"][0], list)
    check_prompt(reference, answer["choices"][0]["prompt_token_ids"], params)


def test_concurrent_matrices_beside_ordinary_traffic_are_never_misattributed(
    client: Any, model_name: str, reference: Reference
) -> None:
    def flagged(i: int) -> tuple[str, dict[str, Any]]:
        pooling = "all_answer" if i % 2 else "all_prompt"
        content = f"Concurrent matrix {i}: {'harbour ' * (i * 11)}"
        return pooling, request(client, model_name, content, pooling, n=1 + i % 3 // 2)

    for pooling, answer in beside_ordinary_traffic(client, model_name, flagged, 10):
        params = answer["kv_transfer_params"]
        if pooling == "all_prompt":
            check_prompt(reference, answer["prompt_token_ids"], params)
            continue
        infos = params.get("last_hidden_state_infos") or [params["last_hidden_state_info"]]
        layers = params["last_hidden_states_by_layer"]
        by_choice = layers if isinstance(layers, list) else [layers]
        for choice, by_layer, info in zip(answer["choices"], by_choice, infos, strict=True):
            check_answer(reference, answer["prompt_token_ids"], choice["token_ids"], by_layer, info)


def test_a_prompt_matrix_over_the_max_record_is_a_413_and_the_server_goes_on(
    client: Any, model_name: str, reference: Reference
) -> None:
    rows = MAX_RECORD_MIB * (1 << 20) // (4 * len(LAYERS) * reference.hidden_size) + 20
    content = "word " * rows
    with pytest.raises(openai.APIStatusError) as raised:
        request(client, model_name, content, "all_prompt", max_completion_tokens=1)
    assert raised.value.status_code == 413
    assert MAX_RECORD_MIB_ENV in raised.value.message
    answer = request(client, model_name, "Still serving?", "all_prompt")
    check_prompt(reference, answer["prompt_token_ids"], answer["kv_transfer_params"])


def test_an_answer_matrix_that_could_exceed_the_max_record_is_refused_before_it_is_sent(
    client: Any, model_name: str, reference: Reference
) -> None:
    rows = MAX_RECORD_MIB * (1 << 20) // (4 * len(LAYERS) * reference.hidden_size) + 1
    with pytest.raises(openai.APIStatusError) as raised:
        request(client, model_name, "Long answer", "all_answer", max_completion_tokens=rows)
    assert raised.value.status_code == 413
    assert getattr(raised.value, "param", None) == "max_completion_tokens"
    assert MAX_RECORD_MIB_ENV in raised.value.message


def spans_for(length: int) -> list[list[int]]:
    """Spans of a prompt of ``length`` tokens: the whole, its ends, and (for a prompt chunked
    over several steps) spans across the chunk boundaries."""
    spans = [[0, length], [0, 1], [length - 1, length], [length // 3, length // 2 + 1]]
    chunk = MAX_NUM_BATCHED_TOKENS
    spans += [[chunk - 2, chunk + 3], [chunk - 1, 2 * chunk + 1]] if length > 2 * chunk + 1 else []
    return spans


def check_spans(
    reference: Reference, prompt_ids: list[int], spans: list[list[int]], params: dict[str, Any]
) -> None:
    info = params["last_hidden_state_info"]
    assert (info["pooling"], info["spans"], info["rows"]) == ("mean", spans, len(spans))
    for label, matrix in params["last_hidden_states_by_layer"].items():
        rows = decode(matrix, reference.hidden_size)
        every = np.asarray(reference.layer_rows(prompt_ids, int(label)), dtype=np.float64)
        assert len(rows) == len(spans)
        for row, (start, end) in zip(rows, spans, strict=True):
            expected = every[start:end].mean(axis=0)
            assert_matches(row.tolist(), expected.tolist(), f"layer {label}, spans")


@pytest.mark.parametrize("mode", ["json", "n2", "stream"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_spans_are_the_means_of_transformers_rows(
    stack: RunningStack,
    client: Any,
    model_name: str,
    reference: Reference,
    prompt: str,
    mode: str,
) -> None:
    content = f"{PROMPTS[prompt]} (spans, {mode})"
    messages = [{"role": "user", "content": content}]
    prompt_ids = reference.chat_token_ids(messages, enable_thinking=False)
    chunked_check(reference, prompt, content)
    warm(stack, client, model_name, prompt, content)
    spans = spans_for(len(prompt_ids))
    kv_spans = {**kv("mean"), "last_hidden_state_spans": spans}
    body = {**NO_THINKING, "kv_transfer_params": kv_spans, "return_token_ids": True}
    if mode == "stream":
        stream = client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=3,
            stream=True,
            extra_body=body,
        )
        carried = [(chunk.model_extra or {}).get("kv_transfer_params") for chunk in stream]
        (params,) = [p for p in carried if p is not None]
        check_spans(reference, prompt_ids, spans, params)
        return
    sampling: dict[str, Any] = {"n": 2, "temperature": 1.0} if mode == "n2" else {}
    answer = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=3,
        extra_body=body,
        **sampling,
    ).model_dump()
    assert answer["prompt_token_ids"] == prompt_ids
    check_spans(reference, prompt_ids, spans, answer["kv_transfer_params"])


def test_a_span_past_the_prompt_is_a_400_and_the_server_goes_on(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Short spans."}]
    length = len(reference.chat_token_ids(messages, enable_thinking=False))
    spans = [[0, 2], [1, length + 1]]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=1,
            extra_body={
                **NO_THINKING,
                "kv_transfer_params": {**kv("mean"), "last_hidden_state_spans": spans},
            },
        )
    assert f"[1, {length + 1}]" in raised.value.message
    answer = request(client, model_name, "Still serving spans?", "all_prompt")
    check_prompt(reference, answer["prompt_token_ids"], answer["kv_transfer_params"])


@pytest.mark.parametrize("pooling", ["all_prompt", "all_answer"])
def test_a_prompt_list_gets_one_matrix_per_prompt_or_choice(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    prompts = ["The harbour at dawn", "A lantern in the fog, seen from the quay"]
    answer = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=3,
        n=2,
        temperature=1.0,
        extra_body={"kv_transfer_params": kv(pooling), "return_token_ids": True},
    ).model_dump()
    params, choices = answer["kv_transfer_params"], answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    by_layer, infos = params["last_hidden_states_by_layer"], params["last_hidden_state_infos"]
    if pooling == "all_prompt":  # one per prompt, in prompt order
        assert len(by_layer) == len(infos) == 2
        for prompt_index, (layers, info) in enumerate(zip(by_layer, infos, strict=True)):
            prompt_ids = choices[2 * prompt_index]["prompt_token_ids"]
            check_prompt(
                reference,
                prompt_ids,
                {
                    "last_hidden_state_info": info,
                    "last_hidden_states_by_layer": layers,
                    "last_hidden_state": layers["-1"],
                },
            )
        return
    assert len(by_layer) == len(infos) == 4  # one per choice of the merged answer
    for choice, layers, info in zip(choices, by_layer, infos, strict=True):
        check_answer(reference, choice["prompt_token_ids"], choice["token_ids"], layers, info)


@pytest.mark.parametrize("fmt", ["base64", "float"])
def test_a_large_matrix_comes_in_pieces_with_transformers_rows(
    client: Any, model_name: str, reference: Reference, fmt: str
) -> None:
    """Issue #36: matrices of 256 KiB or more are sent in pieces, encoded off the event loop
    (no content-length); the rows are the same."""
    rows = 400  # x 3 layers x 128 x 4 bytes: 600 KiB of rows, the final layer's twice
    raw = client.completions.with_raw_response.create(
        model=model_name,
        prompt="word " * (rows - 1),
        max_tokens=1,
        extra_body={
            "kv_transfer_params": kv("all_prompt", last_hidden_state_format=fmt),
            "return_token_ids": True,
        },
    )
    assert "content-length" not in raw.headers
    answer = raw.parse().model_dump()
    params = answer["kv_transfer_params"]
    prompt_ids = answer["choices"][0]["prompt_token_ids"]
    assert params["last_hidden_state_info"]["rows"] == len(prompt_ids) >= rows - 10
    check_prompt(reference, prompt_ids, params)
