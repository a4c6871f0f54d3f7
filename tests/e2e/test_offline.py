"""Hidden states from vLLM's offline ``LLM`` (issue #47), on model runner V1 and V2, against
Transformers: ``generate`` and ``chat`` for every pooling and captured layer (0, 1, -1), short
prompts, prompts chunked over several prefill steps (128 tokens a step) and prompt-cache hits,
answers with two choices, token-id prompts, 16-bit dtypes, ``embed``; 20,000 prompts in one
call (the ring's 1,024 slots many times over) and 2,000 matrices (its arena's 32 MiB twice
over), every one back and a sample against Transformers; the errors that name a prompt.

Each runner's ``LLM`` runs in a process of its own (``tests/e2e/offline_harness.py``), under
the machine-wide vLLM lock: the own-server session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.offline_harness import OfflineCallError, OfflineLLM, run_offline
from tests.e2e.reference import COUNTED, Reference, assert_matches
from tests.e2e.server import RUNNERS, SHARED_HOOK_ENV, SHARED_LAYERS, hook_active_line
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    DEFAULT_TEMPLATE,
    LAYERS_ENV,
    PLACEHOLDER,
)
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.ring.files import RING_SUFFIX, files_named
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

pytestmark = pytest.mark.own_server

LAYERS = [int(layer) for layer in SHARED_LAYERS]
LONG_TEXT = " ".join(
    f"Offline sentence {i} names a meadow, a kettle and the number {i * 7}." for i in range(10)
)
PROMPTS = [
    "Describe a small meadow.",
    f"Summarise: {LONG_TEXT}",  # over 128 tokens: a prefill of several steps
    f"Cached prefix. {LONG_TEXT} Which kettle?",  # its prefix cached by the one before
]
CHATS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": f"Read this: {LONG_TEXT}"}],
    [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": f"Read this: {LONG_TEXT} And then?"},
    ],
]
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0}
#: The fixture's ring: the hook's default slot count, the shared stack's arena.
RING_SLOTS = HookSettings(environ={}).ring_slots
ARENA_MIB = int(SHARED_HOOK_ENV[ARENA_MIB_ENV])
#: Prompts of the corpus test, per runner: V2's steps on interpreted Triton take ~15x V1's
#: (20,000 prompts: 428 s against 28 s), so V2 gets two and a half ring lengths.
CORPUS = {"v1": 20_000, "v2": 2_500}


@pytest.fixture(scope="module", params=RUNNERS)
def offline_llm(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OfflineLLM]:
    runner: str = request.param
    env = {LAYERS_ENV: ",".join(SHARED_LAYERS), **SHARED_HOOK_ENV}
    with run_offline(
        tiny_model_dir, tmp_path_factory.mktemp(f"offline-{runner}"), runner, env
    ) as llm:
        assert hook_active_line(runner) in llm.log(), llm.log_tail()
        COUNTED.append(f"offline LLM ({runner}) ready in {llm.startup_seconds:.0f} s")
        yield llm


def check_prompt_entry(
    reference: Reference, ids: list[int], entry: dict[str, Any], pooling: str, spans: Any = None
) -> None:
    """Each layer's vector (or rows) of one prompt's entry against Transformers on ``ids``."""
    info = entry["info"]
    assert info["num_prompt_tokens"] == len(ids) and info["pooling"] == pooling
    for layer in LAYERS:
        actual = entry["by_layer"][layer]
        kind = f"offline layer {layer}, {pooling}{', spans' if spans else ''}"
        if pooling in ("last", "mean") and spans is None:
            assert actual.shape == (reference.hidden_size,)
            assert_matches(actual.tolist(), reference.layer_vector(ids, layer, pooling), kind)
            continue
        rows = np.asarray(reference.layer_rows(ids, layer), dtype=np.float64)
        expected = (
            [rows[start:end].mean(axis=0) for start, end in spans] if spans is not None else rows
        )
        assert actual.shape == (len(expected), reference.hidden_size)
        for got, want in zip(actual, expected, strict=True):
            assert_matches(got.tolist(), list(want), kind)
    if -1 in LAYERS:
        np.testing.assert_array_equal(entry["vector"], entry["by_layer"][-1])


@pytest.mark.parametrize(
    ("pooling", "spans"),
    [("last", None), ("mean", None), ("all_prompt", None), ("mean", [[0, 3], [2, 9]])],
)
def test_generate_every_prompt_pooling_and_layer(
    offline_llm: OfflineLLM, reference: Reference, pooling: str, spans: Any
) -> None:
    results = offline_llm.call(
        "generate", PROMPTS, sampling=ONE_TOKEN, layers=LAYERS, pooling=pooling, spans=spans
    )
    assert len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = result["prompt_token_ids"]
        assert ids == reference.tokenizer(prompt)["input_ids"]  # in input order
        [entry] = result["entries"]
        check_prompt_entry(reference, ids, entry, pooling, spans)


def test_prefix_cache_hits_keep_the_vectors(offline_llm: OfflineLLM, reference: Reference) -> None:
    """The same prompts again: their prefixes come from the cache (vLLM counts them), and
    their vectors are still Transformers' (``"mean"`` skips the cache: a fresh salt)."""
    offline_llm.call("generate", PROMPTS, sampling=ONE_TOKEN)
    again = offline_llm.call("generate", PROMPTS, sampling=ONE_TOKEN, layers=LAYERS)
    assert all(result["num_cached_tokens"] > 0 for result in again[1:])
    for result in again:
        check_prompt_entry(reference, result["prompt_token_ids"], result["entries"][0], "last")
    means = offline_llm.call("generate", PROMPTS, sampling=ONE_TOKEN, pooling="mean")
    assert all(result["num_cached_tokens"] == 0 for result in means)


@pytest.mark.parametrize("pooling", ["last", "mean", "all_prompt"])
def test_chat_every_pooling_and_layer(
    offline_llm: OfflineLLM, reference: Reference, pooling: str
) -> None:
    results = offline_llm.call(
        "chat", CHATS, sampling=ONE_TOKEN, layers=LAYERS, pooling=pooling, **NO_THINKING
    )
    for messages, result in zip(CHATS, results, strict=True):
        ids = result["prompt_token_ids"]
        assert ids == reference.chat_token_ids(messages, enable_thinking=False)
        check_prompt_entry(reference, ids, result["entries"][0], pooling)


@pytest.mark.parametrize("pooling", ["last_answer", "all_answer"])
def test_answers_of_two_choices(
    offline_llm: OfflineLLM, reference: Reference, pooling: str
) -> None:
    """Per choice, the states that chose its tokens: Transformers on prompt + answer minus its
    last token (``"last_answer"``: the last of them)."""
    sampling = {"max_tokens": 6, "n": 2, "temperature": 1.0, "ignore_eos": True}
    results = offline_llm.call("chat", CHATS[:2], sampling=sampling, layers=LAYERS, pooling=pooling)
    for result in results:
        ids, choices = result["prompt_token_ids"], result["outputs"]
        assert [choice["index"] for choice in choices] == [0, 1]
        assert len(result["entries"]) == 2
        for choice, entry in zip(choices, result["entries"], strict=True):
            answer = choice["token_ids"]
            assert entry["info"]["num_output_tokens"] == len(answer)
            run = ids + answer[:-1]
            for layer in LAYERS:
                actual = entry["by_layer"][layer]
                kind = f"offline layer {layer}, {pooling}"
                if pooling == "last_answer":
                    assert_matches(
                        actual.tolist(), reference.layer_vector(run, layer, "last"), kind
                    )
                    continue
                rows = reference.layer_rows(run, layer)[len(ids) - 1 :]
                assert actual.shape == (len(answer), reference.hidden_size)
                for got, want in zip(actual, rows, strict=True):
                    assert_matches(got.tolist(), want, kind)


def test_token_ids_and_16_bit_dtypes(offline_llm: OfflineLLM, reference: Reference) -> None:
    """Token-id prompts; float16 and bfloat16 are the float32 vectors rounded (as the server's
    base64 and the client module give them)."""
    import ml_dtypes

    prompts = [reference.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    exact = offline_llm.call("generate", prompts, sampling=ONE_TOKEN, layers=LAYERS)
    for ids, result in zip(prompts, exact, strict=True):
        assert result["prompt_token_ids"] == ids
        check_prompt_entry(reference, ids, result["entries"][0], "last")
    for dtype, numpy_type in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        rounded = offline_llm.call("generate", prompts, sampling=ONE_TOKEN, dtype=dtype)
        for result, base in zip(rounded, exact, strict=True):
            want = base["entries"][0]["vector"].astype(numpy_type).astype(np.float32)
            np.testing.assert_array_equal(result["entries"][0]["vector"], want)
            assert result["entries"][0]["info"]["dtype"] == dtype


def test_embed_as_the_servers_embeddings(offline_llm: OfflineLLM, reference: Reference) -> None:
    texts = ["A yellow bicycle.", "A stone wall beside it."]
    vectors = offline_llm.call("embed", texts, layer=1, pooling="mean")
    assert vectors.shape == (2, reference.hidden_size)
    for text, vector in zip(texts, vectors, strict=True):
        message = {"role": "user", "content": DEFAULT_TEMPLATE.replace(PLACEHOLDER, text)}
        ids = reference.chat_token_ids([message], enable_thinking=False)
        expected = np.asarray(reference.layer_vector(ids, 1, "mean"))
        assert_matches(vector.tolist(), list(expected / np.linalg.norm(expected)), "embed")
    raw = offline_llm.call("embed", texts, template=None, normalize=False)
    for text, vector in zip(texts, raw, strict=True):
        ids = reference.tokenizer(text)["input_ids"]
        assert_matches(vector.tolist(), reference.last_hidden_state(ids), "embed raw")


def test_a_corpus_larger_than_the_ring(offline_llm: OfflineLLM, reference: Reference) -> None:
    """20,000 short prompts in one call, 20 ring lengths (V2: 2,500): every one comes back, in
    order, with its own vector (a sample against Transformers); the ring did turn over."""
    count = CORPUS[offline_llm.runner]
    prompts = [f"Item {i}: a short line." for i in range(count)]
    before = _publish_count(offline_llm)
    results = offline_llm.call("generate", prompts, sampling=ONE_TOKEN, use_tqdm=False)
    assert len(results) == count
    published = _publish_count(offline_llm) - before
    assert published >= count > 2 * RING_SLOTS
    sample = range(0, count, count // 40)
    for i in sample:
        ids = results[i]["prompt_token_ids"]
        assert ids == reference.tokenizer(prompts[i])["input_ids"]
        assert_matches(
            results[i]["entries"][0]["vector"].tolist(), reference.last_hidden_state(ids)
        )
    assert all(
        result["entries"][0]["vector"].shape == (reference.hidden_size,) for result in results
    )
    COUNTED.append(
        f"offline corpus ({offline_llm.runner}): {count} prompts, {published} records "
        f"published in a ring of {RING_SLOTS} slots, all read"
    )


def test_matrices_beyond_the_arena(offline_llm: OfflineLLM, reference: Reference) -> None:
    """2,000 ``"all_prompt"`` matrices of three layers, more than the arena together: every one
    back, whole, and a sample against Transformers. (V1 only: how many are added at once is
    decided in the calling process, whatever the runner; V2's matrices are tested above.)"""
    if offline_llm.runner != "v1":
        pytest.skip("the window over the arena does not depend on the runner (49 s on V2)")
    prompts = [f"Row {i} of the matrices, with a few more words in it." for i in range(2000)]
    results = offline_llm.call(
        "generate", prompts, sampling=ONE_TOKEN, layers=LAYERS, pooling="all_prompt", use_tqdm=False
    )
    total = sum(result["entries"][0]["by_layer"][0].nbytes * len(LAYERS) for result in results)
    assert total > ARENA_MIB << 20
    for result in results:
        assert result["entries"][0]["by_layer"][1].shape[0] == len(result["prompt_token_ids"])
    for i in (0, 999, 1999):
        check_prompt_entry(
            reference, results[i]["prompt_token_ids"], results[i]["entries"][0], "all_prompt"
        )


def _publish_count(llm: OfflineLLM) -> int:
    """Records published so far into the ``LLM``'s one ring."""
    [(path, _)] = files_named(llm.ring_dir, RING_SUFFIX)
    with RingReader.open(path) as ring:
        return ring.publish_count()


def test_errors_name_the_prompt_or_the_option(offline_llm: OfflineLLM) -> None:
    with pytest.raises(OfflineCallError) as refused:
        offline_llm.call("generate", PROMPTS, sampling=ONE_TOKEN, layers=[5])
    assert refused.value.kind == "HiddenStateRequestError"
    assert "Layer 5 is not captured" in refused.value.message
    with pytest.raises(OfflineCallError) as past:
        offline_llm.call(
            "generate",
            ["Short.", "Also short."],
            sampling=ONE_TOKEN,
            pooling="mean",
            spans=[[0, 50]],
        )
    assert past.value.status == 400 and past.value.index == 0
    assert "prompt 0 ('Short.')" in past.value.message
    with pytest.raises(OfflineCallError) as large:
        offline_llm.call(
            "generate", PROMPTS, sampling={"max_tokens": 1000}, pooling="all_answer", layers=LAYERS
        )
    assert large.value.status == 413 and "HIDDEN_STATE_PROXY_MAX_RECORD_MIB" in large.value.message
    reserved = {**ONE_TOKEN, "extra_args": {"hidden_state_proxy_key": "00" * 16}}
    with pytest.raises(OfflineCallError, match="may not set entries"):
        offline_llm.call("generate", PROMPTS, sampling=reserved)
    # The LLM is still usable after each of them.
    assert len(offline_llm.call("generate", PROMPTS, sampling=ONE_TOKEN)) == len(PROMPTS)
