"""A tiny Qwen3.5 (hybrid: Gated DeltaNet linear attention and full attention) end to end, on
model runner V1 and V2, against Transformers (issue #35).

Each runner gets its own server (``own_server``) on :mod:`tests.e2e.tiny_qwen3_5`'s model, in
bfloat16 (vLLM's CPU linear attention requires it), capturing layers 0 (embeddings), 1 (after
the first linear-attention layer), 2 (after the first full-attention layer) and the final layer.

**Tolerance and attribution.** The reference reads the bf16 weights in float32, vLLM computes
in bf16: the two differ by ~1-3% (relative L2), which is as large as the distance between some
prompts' vectors. A tolerance alone could not catch one prompt's vector returned for another,
so every vector is also checked to be nearer its own prompt's reference than any other
prompt's, wherever those references are far enough apart to tell (:func:`check_vectors`).
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
#: bf16 against a float32 reading of the same weights (measured: at most ~0.03).
MAX_RELATIVE_L2 = 0.06
MIN_COSINE = 0.998
#: References closer than this are not told apart by the attribution check.
DISTINCT = 3 * MAX_RELATIVE_L2
#: vLLM's block for this model with prefix caching (a whole linear-attention state a block).
HYBRID_BLOCK_TOKENS = 384
LONG_TEXT = " ".join(
    f"Line {i} names a river, a bridge, a colour and the number {i * 13}." for i in range(22)
)
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
) -> None:
    """Each layer's vector within bf16 of its own reference, and nearer to it than to any other
    prompt's reference that is :data:`DISTINCT` from it."""
    assert list(by_layer) == LAYERS
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
        check_vectors(runner, params["last_hidden_states_by_layer"], pooling, refs[name], others)
        assert params["last_hidden_state"] == params["last_hidden_states_by_layer"]["-1"]


def test_a_prefix_cache_hit_in_hybrid_blocks_gives_the_right_vectors(
    qwen_stack: tuple[str, RunningStack], qwen_reference: Reference
) -> None:
    runner, stack = qwen_stack
    client = openai_client(stack)
    first, second = f"{LONG_TEXT} First?", f"{LONG_TEXT} And the second one, longer?"
    first_ids, second_ids = prompt_ids(qwen_reference, first), prompt_ids(qwen_reference, second)
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    assert shared >= HYBRID_BLOCK_TOKENS, "the shared prefix must fill a hybrid cache block"
    flagged_chat(client, first, "last")
    hits = prefix_cache_hits(stack)
    last = flagged_chat(client, second, "last")
    assert prefix_cache_hits(stack) > hits, "the second prompt should hit the prefix cache"
    mean = flagged_chat(client, second, "mean")  # recomputed: mean is sent with a fresh salt
    other = references(qwen_reference, first_ids, "last")
    check_vectors(
        runner,
        last["last_hidden_states_by_layer"],
        "last",
        references(qwen_reference, second_ids, "last"),
        [other],
    )
    check_vectors(
        runner,
        mean["last_hidden_states_by_layer"],
        "mean",
        references(qwen_reference, second_ids, "mean"),
        [references(qwen_reference, first_ids, "mean")],
    )
