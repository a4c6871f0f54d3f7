"""A tiny Qwen3.5 (hybrid: Gated DeltaNet linear attention and full attention) end to end, on
model runner V1 and V2, against Transformers (issue #35).

Each runner gets its own server (``own_server``) on :mod:`tests.e2e.tiny_qwen3_5`'s model, in
bfloat16 (vLLM's CPU linear attention requires it), capturing layers 0 (embeddings), 1 (after
the first linear-attention layer), 2 (after the first full-attention layer) and the final layer.

**Tolerance and attribution.** The reference reads the bf16 weights in float32, vLLM computes
in bf16: the two differ by a few percent (relative L2; the measured worst is in
CONTRIBUTING.md, "What runs where"). A tolerance alone could not catch one prompt's vector
returned for another, so every vector is also checked to be nearer its own prompt's reference
than any other prompt's, wherever those references are far enough apart to tell
(:func:`check_vectors`); the prompts are chosen so that they are, on every layer but the
embeddings (:data:`ATTRIBUTED`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import MEASURED, Reference, compare
from tests.e2e.server import (
    MAX_NUM_BATCHED_TOKENS,
    RUNNERS,
    TORCHVISION_STUB_ENV,
    RunningStack,
    require_runner,
    run_serve,
)
from tests.e2e.stack_probe import prefix_cache_hits
from tests.e2e.tiny_qwen3_5 import build_tiny_qwen3_5

pytestmark = pytest.mark.own_server

LAYERS = ["0", "1", "2", "-1"]
#: bf16 against a float32 reading of the same weights (measured worst: CONTRIBUTING.md, "What
#: runs where"; under two thirds of this).
MAX_RELATIVE_L2 = 0.06
MIN_COSINE = 0.998
#: References closer than this are not told apart by the attribution check.
DISTINCT = 3 * MAX_RELATIVE_L2
#: The layers whose vectors the attribution check must tell apart: all but the embeddings,
#: whose last row is the chat template's last token, the same for every prompt.
ATTRIBUTED = {"1", "2", "-1"}
#: vLLM's block for this model with prefix caching (a whole linear-attention state a block):
#: 384 tokens where vLLM's CPU backend keeps that state in float32 (a CPU with AVX512-BF16),
#: 256 where it keeps it in bfloat16; the larger.
HYBRID_BLOCK_TOKENS = 384
LINES = [f"Line {i} names a river, a bridge, a colour and the number {i * 13}." for i in range(22)]
LONG_TEXT = " ".join(LINES)
PROMPTS = {
    "short": "What is the capital of France?",
    "chunked": "Summarise: " + LONG_TEXT[:1400],
    "other": "Red, orange, yellow, green, blue. " * 6,
}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def qwen_reference(qwen_dir: Path) -> Reference:
    return Reference(qwen_dir)


@pytest.fixture(scope="module", params=RUNNERS)
def qwen_stack(
    request: pytest.FixtureRequest, qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, RunningStack]]:
    runner: str = request.param
    args = ["--dtype", "bfloat16", "--hidden-state-layers", ",".join(LAYERS)]
    with run_serve(
        qwen_dir,
        tmp_path_factory.mktemp(f"qwen3_5-{runner}"),
        args,
        {TORCHVISION_STUB_ENV: "1"},
        runner=runner,
    ) as running:
        require_runner(running, runner)
        yield runner, running


def openai_client(stack: RunningStack) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def flagged_chat(client: Any, content: str, pooling: str) -> dict[str, Any]:
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_completion_tokens=1,
        extra_body={
            **NO_THINKING,
            "kv_transfer_params": {
                "return_last_hidden_state": True,
                "last_hidden_state_pooling": pooling,
                "last_hidden_state_layers": [int(layer) for layer in LAYERS],
                "last_hidden_state_info": True,
            },
        },
    )
    params: dict[str, Any] = response.model_dump()["kv_transfer_params"]
    return params


def prompt_ids(reference: Reference, content: str) -> list[int]:
    return reference.chat_token_ids([{"role": "user", "content": content}], enable_thinking=False)


def check_vectors(
    runner: str,
    by_layer: dict[str, Sequence[float]],
    pooling: str,
    own: dict[str, list[float]],
    others: Sequence[dict[str, list[float]]],
) -> set[str]:
    """Each layer's vector within bf16 of its own reference, and nearer to it than to any other
    prompt's reference that is :data:`DISTINCT` from it; returns the layers that attribution
    check ran on (a caller relying on it asserts which)."""
    assert list(by_layer) == LAYERS
    attributed: set[str] = set()
    for label, vector in by_layer.items():
        cosine, rel_l2 = compare(vector, own[label])
        MEASURED.setdefault(f"qwen3.5 {runner}, layer {label}, {pooling} (bf16)", []).append(
            (cosine, rel_l2)
        )
        assert cosine >= MIN_COSINE and rel_l2 <= MAX_RELATIVE_L2, (
            f"layer {label} {pooling}: cosine={cosine:.6f} rel_l2={rel_l2:.3e}"
        )
        for other in others:
            if compare(other[label], own[label])[1] > DISTINCT:
                assert compare(vector, other[label])[1] > 2 * rel_l2, (
                    f"layer {label} {pooling}: the vector is as near another prompt's state"
                )
                attributed.add(label)
    return attributed


def references(reference: Reference, ids: list[int], pooling: str) -> dict[str, list[float]]:
    return {label: reference.layer_vector(ids, int(label), pooling) for label in LAYERS}


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_every_layer_short_and_chunked_prompts(
    qwen_stack: tuple[str, RunningStack], qwen_reference: Reference, pooling: str
) -> None:
    runner, stack = qwen_stack
    client = openai_client(stack)
    ids = {name: prompt_ids(qwen_reference, text) for name, text in PROMPTS.items()}
    assert len(ids["chunked"]) > 2 * MAX_NUM_BATCHED_TOKENS, "must span several prefill steps"
    refs = {name: references(qwen_reference, ids[name], pooling) for name in PROMPTS}
    for name, text in PROMPTS.items():
        params = flagged_chat(client, text, pooling)
        info = params["last_hidden_state_info"]
        assert info["num_prompt_tokens"] == len(ids[name])
        assert info["hidden_size"] == qwen_reference.hidden_size
        others = [refs[other] for other in PROMPTS if other != name]
        by_layer = params["last_hidden_states_by_layer"]
        assert check_vectors(runner, by_layer, pooling, refs[name], others) >= ATTRIBUTED
        assert params["last_hidden_state"] == params["last_hidden_states_by_layer"]["-1"]


def test_a_prefix_cache_hit_in_hybrid_blocks_gives_the_right_vectors(
    qwen_stack: tuple[str, RunningStack], qwen_reference: Reference
) -> None:
    runner, stack = qwen_stack
    client = openai_client(stack)
    # The two part right after a shared prefix just over one hybrid block, and then go on for
    # a hundred tokens and more: a state taken from the wrong prompt's block, or lost at the
    # hit, shows in every layer but the embeddings, in last and in mean.
    shared_text = " ".join(LINES[:14])
    first = f"{shared_text} Then the colours, once more: " + (
        "red, orange, yellow, green, blue, indigo, violet; " * 6
    )
    second = f"{shared_text} Then the multiples of seven, in order: " + ", ".join(
        str(7 * i) for i in range(1, 40)
    )
    first_ids, second_ids = prompt_ids(qwen_reference, first), prompt_ids(qwen_reference, second)
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    assert shared >= HYBRID_BLOCK_TOKENS, "the shared prefix must fill a hybrid cache block"
    # Where vLLM's CPU backend keeps the linear-attention state in bfloat16 (256-token blocks,
    # no AVX512-BF16), the prompt right after the first on a shared prefix finds no cached block
    # and the one after that does (vLLM 0.32, mamba "align" mode); with 384-token blocks each
    # prompt after the first does. So another prompt on the prefix goes before the second.
    primer = f"{shared_text} Then the days of the week: " + (
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; " * 5
    )
    primer_ids = prompt_ids(qwen_reference, primer)
    flagged_chat(client, first, "last")
    flagged_chat(client, primer, "last")
    hits = prefix_cache_hits(stack)
    last = flagged_chat(client, second, "last")
    assert prefix_cache_hits(stack) > hits, "the third prompt should hit the prefix cache"
    mean = flagged_chat(client, second, "mean")  # recomputed: mean is sent with a fresh salt
    for pooling, params in (("last", last), ("mean", mean)):
        attributed = check_vectors(
            runner,
            params["last_hidden_states_by_layer"],
            pooling,
            references(qwen_reference, second_ids, pooling),
            [references(qwen_reference, ids, pooling) for ids in (first_ids, primer_ids)],
        )
        assert attributed >= ATTRIBUTED, f"{pooling}: told apart on layers {sorted(attributed)}"
