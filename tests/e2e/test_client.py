"""The client module (issue #37) on real vLLM through the official openai client: every kind of
answer, decoded by ``read_hidden_states`` or ``HiddenStateStream``, equals Transformers' arrays
(the suite's tolerance), and the server's capture description is what it serves.

Kinds: last and mean over every captured layer, JSON floats, spans, all_prompt (float32 and
bfloat16), all_answer and last_answer with n = 2, a completions prompt list, 16-bit dtypes (with
and without the info), a JSON responses answer, and streams of chat (per choice: last_answer
through the SDK, all_answer as raw SSE text), completions and responses.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import SHARED_LAYERS, RunningStack
from vllm_hidden_state_proxy.client import (
    CAPTURE_PATH,
    Array,
    HiddenStates,
    HiddenStateServerError,
    HiddenStateStream,
    hidden_state_fields,
    read_capture,
    read_hidden_states,
)

LAYERS = [int(layer) for layer in SHARED_LAYERS]


def kind(layer: int, pooling: str) -> str:
    return f"layer {layer}, {pooling}"


def body(**fields: Any) -> dict[str, Any]:
    """``extra_body``: the client's fields, every captured layer, with info and token ids."""
    fields.setdefault("layers", LAYERS)
    fields.setdefault("info", True)
    return {**NO_THINKING, **hidden_state_fields(**fields), "return_token_ids": True}


def chat(client: Any, model: str, content: str, **options: Any) -> Any:
    extra_body = options.pop("extra_body")
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body=extra_body,
        **{"max_completion_tokens": 1, "temperature": 0, **options},
    )


def check_vectors(
    reference: Reference, ids: list[int], entry: HiddenStates, pooling: str = "last"
) -> None:
    """Each layer's vector (and the final one) against Transformers' on ``ids``."""
    assert sorted(entry.by_layer) == sorted(LAYERS)
    assert entry.vector is not None
    np.testing.assert_array_equal(entry.vector, entry.layer(-1))
    for layer, vector in entry.by_layer.items():
        assert vector.dtype == np.float32 and vector.shape == (reference.hidden_size,)
        expected = reference.layer_vector(ids, layer, pooling)
        assert_matches(vector.tolist(), expected, kind(layer, pooling))


def check_rows(
    reference: Reference, ids: list[int], first: int, matrix: Array, layer: int, pooling: str
) -> None:
    """A matrix against Transformers' rows ``first ..`` of layer ``layer`` on ``ids``."""
    expected = reference.layer_rows(ids, layer)[first:]
    assert matrix.shape == (len(expected), reference.hidden_size), matrix.shape
    for row, want in zip(matrix, expected, strict=True):
        assert_matches(row.tolist(), want, kind(layer, pooling))


def test_the_capture_description_is_what_the_server_serves(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    response = httpx.get(stack.proxy_url + CAPTURE_PATH, timeout=30)
    capture = read_capture(response)
    final = reference.num_hidden_layers
    assert capture.model == model_name
    assert (capture.hidden_size, capture.num_hidden_layers) == (reference.hidden_size, final)
    assert capture.layers == tuple(sorted({k if k >= 0 else final + 1 + k for k in LAYERS}))
    assert "all_prompt" in capture.poolings and capture.limits["arena_bytes"] > 0
    assert [engine.layers for engine in capture.engines] == [capture.layers]
    assert capture.engines[0].runner.startswith("vLLM 0.32")


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_last_and_mean_of_every_layer(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    response = chat(
        client, model_name, f"Client {pooling}: a lighthouse.", extra_body=body(pooling=pooling)
    )
    states = read_hidden_states(response)
    assert states.info is not None and states.info["pooling"] == pooling
    check_vectors(reference, response.model_dump()["prompt_token_ids"], states.single, pooling)


def test_json_floats_of_every_layer(client: Any, model_name: str, reference: Reference) -> None:
    response = chat(client, model_name, "Client floats.", extra_body=body(format="float"))
    kv = response.model_dump()["kv_transfer_params"]
    assert isinstance(kv["last_hidden_state"], list)  # floats, not base64
    states = read_hidden_states(response)
    check_vectors(reference, response.model_dump()["prompt_token_ids"], states.single)


def assert_rounded(actual: Array, expected: Any, dtype: str) -> None:
    """16-bit values: within one unit in the last place of Transformers' float32 value (half a
    unit for the rounding, plus float32 values a hair apart rounding apart)."""
    relative = 2.0**-10 if dtype == "float16" else 2.0**-7
    want = np.asarray(expected, dtype=np.float32)
    assert actual.shape == want.shape, (actual.shape, want.shape)
    np.testing.assert_allclose(actual, want, rtol=relative, atol=1e-6)


@pytest.mark.parametrize("info", [True, False], ids=["with info", "without info"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_vectors_decode_to_transformers_rounded(
    client: Any, model_name: str, reference: Reference, dtype: str, info: bool
) -> None:
    response = chat(client, model_name, "Client 16-bit.", extra_body=body(dtype=dtype, info=info))
    assert response.model_dump()["kv_transfer_params"]["last_hidden_state_dtype"] == dtype
    states = read_hidden_states(response)  # the answer says its dtype: no dtype= needed
    ids = response.model_dump()["prompt_token_ids"]
    for layer, vector in states.by_layer.items():
        assert_rounded(vector, reference.layer_vector(ids, layer, "last"), dtype)


def test_bfloat16_all_prompt_rows(client: Any, model_name: str, reference: Reference) -> None:
    fields = body(pooling="all_prompt", dtype="bfloat16")
    response = chat(client, model_name, "Client bfloat16 rows.", extra_body=fields)
    states = read_hidden_states(response)
    ids = response.model_dump()["prompt_token_ids"]
    assert states.info is not None and states.info["rows"] == len(ids)
    for layer, matrix in states.by_layer.items():
        assert_rounded(matrix, reference.layer_rows(ids, layer), "bfloat16")


def test_spans_are_one_mean_row_each(client: Any, model_name: str, reference: Reference) -> None:
    spans = [[0, 3], [2, 7], [5, 6]]
    response = chat(client, model_name, "Client spans: a harbour.", extra_body=body(spans=spans))
    states = read_hidden_states(response)
    ids = response.model_dump()["prompt_token_ids"]
    for layer, matrix in states.by_layer.items():
        rows = np.asarray(reference.layer_rows(ids, layer), dtype=np.float64)
        assert matrix.shape == (len(spans), reference.hidden_size)
        for row, (start, end) in zip(matrix, spans, strict=True):
            expected = rows[start:end].mean(axis=0)
            assert_matches(row.tolist(), expected.tolist(), kind(layer, "spans"))


def test_all_prompt_rows(client: Any, model_name: str, reference: Reference) -> None:
    response = chat(client, model_name, "Client all_prompt.", extra_body=body(pooling="all_prompt"))
    states = read_hidden_states(response)
    ids = response.model_dump()["prompt_token_ids"]
    assert states.info is not None and states.info["rows"] == len(ids)
    for layer, matrix in states.by_layer.items():
        check_rows(reference, ids, 0, matrix, layer, "all_prompt")


@pytest.mark.parametrize("pooling", ["last_answer", "all_answer"])
def test_answer_poolings_with_two_choices_are_per_choice(
    client: Any, model_name: str, reference: Reference, pooling: str
) -> None:
    response = chat(
        client,
        model_name,
        f"Client {pooling}: name a sea.",
        n=2,
        temperature=1.0,
        max_completion_tokens=4,
        extra_body=body(pooling=pooling),
    )
    dumped = response.model_dump()
    states = read_hidden_states(response)
    assert len(states) == 2
    prompt_ids = dumped["prompt_token_ids"]
    for choice, entry in zip(dumped["choices"], states.entries, strict=True):
        ids = [*prompt_ids, *choice["token_ids"][:-1]]
        if pooling == "last_answer":
            check_vectors(reference, ids, entry)
        else:
            for layer, matrix in entry.by_layer.items():
                check_rows(reference, ids, len(prompt_ids) - 1, matrix, layer, pooling)


def test_a_completions_prompt_list_is_one_entry_per_prompt(
    client: Any, model_name: str, reference: Reference
) -> None:
    prompts = [
        reference.tokenizer("Client list: first prompt.")["input_ids"],
        reference.tokenizer("Client list: the second, longer prompt here.")["input_ids"],
    ]
    response = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=1, extra_body=body()
    )
    states = read_hidden_states(response)
    assert len(states) == len(prompts)
    for ids, entry in zip(prompts, states.entries, strict=True):
        check_vectors(reference, ids, entry)


def test_a_chat_stream_with_two_choices_gives_each_its_answer_state(
    client: Any, model_name: str, reference: Reference
) -> None:
    stream = chat(
        client,
        model_name,
        "Client stream: name a river.",
        n=2,
        temperature=1.0,
        max_completion_tokens=4,
        stream=True,
        extra_body=body(pooling="last_answer"),
    )
    reader = HiddenStateStream()
    prompt_ids: list[int] = []
    answers: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream:
        reader.feed(chunk)
        prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            answers[choice.index] += (choice.model_extra or {}).get("token_ids") or []
    states = reader.result()
    assert len(states) == 2
    for index, entry in enumerate(states.entries):
        check_vectors(reference, [*prompt_ids, *answers[index][:-1]], entry)


def test_a_raw_sse_stream_of_all_answer_with_two_choices(
    stack: RunningStack, model_name: str, reference: Reference
) -> None:
    """httpx's iter_text() pieces fed as they come (several events in one piece, or part of
    one): each choice's rows, on its last chunk, equal Transformers'."""
    request = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Client raw stream: name a lake."}],
        "n": 2,
        "temperature": 1.0,
        "max_completion_tokens": 4,
        "stream": True,
        **body(pooling="all_answer"),
    }
    reader = HiddenStateStream()
    pieces: list[str] = []
    with httpx.stream(
        "POST", stack.proxy_url + "/v1/chat/completions", json=request, timeout=120
    ) as response:
        assert response.status_code == 200
        for piece in response.iter_text():
            pieces.append(piece)
            reader.feed(piece)
    states = reader.result()
    assert len(states) == 2
    prompt_ids: list[int] = []
    answers: dict[int, list[int]] = {0: [], 1: []}
    for line in "".join(pieces).splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            for choice in chunk["choices"]:
                answers[choice["index"]] += choice.get("token_ids") or []
    for index, entry in enumerate(states.entries):
        ids = [*prompt_ids, *answers[index][:-1]]
        assert entry.info is not None and entry.info["rows"] == len(answers[index])
        for layer, matrix in entry.by_layer.items():
            check_rows(reference, ids, len(prompt_ids) - 1, matrix, layer, "all_answer")


def test_a_completions_stream_gives_the_prompt_state(
    client: Any, model_name: str, reference: Reference
) -> None:
    ids = reference.tokenizer("Client completions stream.")["input_ids"]
    stream = client.completions.create(
        model=model_name, prompt=ids, max_tokens=3, stream=True, extra_body=body()
    )
    states = HiddenStateStream().feed_all(stream)
    check_vectors(reference, ids, states.single)


def test_a_responses_stream_gives_the_state_on_completed(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Client responses stream."}]
    fields = body()
    del fields["return_token_ids"]
    reader = HiddenStateStream()
    final = None
    for event in client.responses.create(
        model=model_name, input=messages, max_output_tokens=3, stream=True, extra_body=fields
    ):
        reader.feed(event)
        final = getattr(event, "response", final)
    assert final is not None
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert final.usage.input_tokens == len(ids)
    check_vectors(reference, ids, reader.result().single)
    # the final response object reads the same
    np.testing.assert_array_equal(read_hidden_states(final).vector, reader.result().vector)  # type: ignore[arg-type]


def test_a_responses_answer_gives_the_prompt_state(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Client responses: a meadow."}]
    fields = body()
    del fields["return_token_ids"]
    response = client.responses.create(
        model=model_name, input=messages, max_output_tokens=3, extra_body=fields
    )
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert response.usage.input_tokens == len(ids)
    check_vectors(reference, ids, read_hidden_states(response).single)


def test_a_layer_the_server_does_not_capture_is_the_servers_400(stack: RunningStack) -> None:
    response = httpx.post(
        stack.proxy_url + "/v1/completions",
        json={"model": "x", "prompt": "p", **hidden_state_fields(layers=[5])},
        timeout=30,
    )
    with pytest.raises(HiddenStateServerError) as raised:
        read_hidden_states(response)
    assert raised.value.status == 400 and "not captured" in raised.value.message
