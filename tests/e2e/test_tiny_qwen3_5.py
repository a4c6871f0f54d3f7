"""The tiny Qwen3.5's linear attention remembers the whole prompt (no server: Transformers on
the CPU, a few seconds).

The hybrid-model tests (``test_qwen3_5.py``) can only catch a linear-attention state that vLLM
loses between prefill chunks, or takes from the wrong block at a prefix-cache hit, if that state
changes the vectors by far more than bf16's error. These tests keep the model builder honest
about that: a model whose linear attention forgets within a few tokens (Transformers' random
init) fails them.
"""

from __future__ import annotations

import pytest

from tests.e2e.reference import Reference, compare
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS
from tests.e2e.test_qwen3_5 import DISTINCT, MAX_RELATIVE_L2, PROMPTS, prompt_ids
from tests.e2e.tiny_qwen3_5 import LAYER_TYPES, build_tiny_qwen3_5

#: After the first decoder layer, a linear-attention one: its output at a position depends on
#: the earlier tokens only through the linear state (and a 4-token convolution).
LINEAR_LAYER = 1


@pytest.fixture(scope="module")
def qwen_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    assert LAYER_TYPES[LINEAR_LAYER - 1] == "linear_attention"
    return Reference(build_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5"))


def rows(reference: Reference, ids: list[int]) -> list[list[float]]:
    return reference.layer_rows(ids, LINEAR_LAYER)


def mean(vectors: list[list[float]]) -> list[float]:
    return [sum(column) / len(vectors) for column in zip(*vectors, strict=True)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_linear_state_carried_across_prefill_chunks_changes_the_vectors(
    qwen_reference: Reference, pooling: str
) -> None:
    """The reference against the same prompt with the linear state reset at each prefill
    chunk's start (each chunk run on its own): far apart, so a server that dropped the state
    between chunks would fail the hybrid tests' tolerance."""
    ids = prompt_ids(qwen_reference, PROMPTS["chunked"])
    assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS
    carried = rows(qwen_reference, ids)
    reset = [
        row
        for start in range(0, len(ids), MAX_NUM_BATCHED_TOKENS)
        for row in rows(qwen_reference, ids[start : start + MAX_NUM_BATCHED_TOKENS])
    ]
    assert len(reset) == len(carried)
    if pooling == "last":
        rel_l2 = compare(reset[-1], carried[-1])[1]
    else:
        rel_l2 = compare(mean(reset), mean(carried))[1]
    assert rel_l2 > 3 * MAX_RELATIVE_L2, f"{pooling}: the reset state moves it by {rel_l2:.3f}"


def test_the_last_tokens_state_tells_the_prompts_apart(qwen_reference: Reference) -> None:
    """Every prompt ends in the same chat-template tokens: their last rows differ only by what
    the linear state remembers of the prompts, and must be far enough apart for the hybrid
    tests' attribution check (:data:`tests.e2e.test_qwen3_5.DISTINCT`)."""
    last = {
        name: rows(qwen_reference, prompt_ids(qwen_reference, text))[-1]
        for name, text in PROMPTS.items()
    }
    names = list(last)
    for i, name in enumerate(names):
        for other in names[i + 1 :]:
            rel_l2 = compare(last[name], last[other])[1]
            assert rel_l2 > DISTINCT, f"{name} and {other}: {rel_l2:.3f}"
