"""pooling.MeanPooling on synthetic CPU tensors: float32 sums across a prompt's prefill steps.

Each request's prompt has fixed rows per layer (a real model computes the same state for a
position whenever it computes it); a step places the rows of the positions it computes at the
request's rows of the step tensors, among rows of other requests. The means are checked
against float64 means of the rows as the model's dtype holds them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
import torch

from vllm_hidden_state_proxy.worker_hook.pooling import MeanPooling
from vllm_hidden_state_proxy.worker_hook.selection import MeanGap, ScheduledRequest

HIDDEN = 8
LAYERS = (0, 3, 6)


class Prompt:
    """One request's prompt rows per layer, held in ``dtype``."""

    def __init__(self, req_id: str, length: int, dtype: torch.dtype, seed: int) -> None:
        self.req_id = req_id
        self.length = length
        generator = torch.Generator().manual_seed(seed)
        self.rows = {
            layer: (torch.randn(length, HIDDEN, generator=generator) * 3 + layer).to(dtype)
            for layer in LAYERS
        }

    def expected(self, layer: int) -> npt.NDArray[np.float64]:
        held: npt.NDArray[np.float64] = self.rows[layer].to(torch.float64).mean(dim=0).numpy()
        return held

    def step(
        self, nc: int, ns: int, *, before: int = 0, after: int = 0
    ) -> tuple[ScheduledRequest, dict[int, torch.Tensor]]:
        """A step computing positions ``nc .. nc + ns - 1`` (rows past the prompt: outputs),
        after ``before`` and followed by ``after`` rows of other requests."""
        dtype = self.rows[LAYERS[0]].dtype
        tensors = {}
        for layer in LAYERS:
            mine = torch.full((ns, HIDDEN), 1e4).to(dtype)  # output tokens: not in the mean
            prompt_part = self.rows[layer][nc : min(nc + ns, self.length)]
            mine[: len(prompt_part)] = prompt_part
            others = torch.full((before + after, HIDDEN), -1e4).to(dtype)
            tensors[layer] = torch.cat([others[:before], mine, others[before:]])
        request = ScheduledRequest(self.req_id, before, nc, ns, self.length)
        return request, tensors


def add(
    means: MeanPooling,
    prompt: Prompt,
    nc: int,
    ns: int,
    layers: Sequence[int] = LAYERS,
    *,
    before: int = 0,
    after: int = 0,
) -> list[torch.Tensor] | None:
    request, tensors = prompt.step(nc, ns, before=before, after=after)
    return means.add(request, layers, tensors)


def assert_mean(got: Sequence[torch.Tensor] | None, prompt: Prompt, layers: Sequence[int]) -> None:
    assert got is not None
    assert len(got) == len(layers)
    for vector, layer in zip(got, layers, strict=True):
        assert vector.dtype == torch.float32
        assert vector.shape == (HIDDEN,)
        np.testing.assert_allclose(vector.numpy(), prompt.expected(layer), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunks_over_several_steps_give_the_mean_of_every_layer(dtype: torch.dtype) -> None:
    prompt = Prompt("m", 10, dtype, seed=1)
    means = MeanPooling()
    assert add(means, prompt, 0, 3, before=2) is None
    assert len(means) == 1
    assert add(means, prompt, 3, 4, after=5) is None
    got = add(means, prompt, 7, 3, before=1, after=1)
    assert_mean(got, prompt, LAYERS)
    assert len(means) == 0  # the sum is gone once the mean is out


def test_the_vectors_follow_the_order_of_the_wanted_layers() -> None:
    prompt = Prompt("m", 4, torch.float32, seed=2)
    got = add(MeanPooling(), prompt, 0, 4, (6, 0))
    assert_mean(got, prompt, (6, 0))


def test_sums_are_float32_even_for_half_precision_rows() -> None:
    """1 + 2**-7 is a bfloat16 number; summing 600 of them in bfloat16 drifts by ~1 %."""
    prompt = Prompt("m", 600, torch.bfloat16, seed=3)
    for layer in LAYERS:
        prompt.rows[layer] = torch.full((600, HIDDEN), 1 + 2**-7, dtype=torch.bfloat16)
    means = MeanPooling()
    got = None
    for nc in range(0, 600, 64):
        assert got is None
        got = add(means, prompt, nc, min(64, 600 - nc))
    assert got is not None
    assert all(bool((vector == 1 + 2**-7).all()) for vector in got)


def test_recomputation_after_preemption_skips_the_positions_already_summed() -> None:
    prompt = Prompt("m", 12, torch.float32, seed=4)
    means = MeanPooling()
    assert add(means, prompt, 0, 6) is None
    # Preempted; re-prefilled from scratch in chunks of 4 and 8 (plus 2 output tokens).
    assert add(means, prompt, 0, 4, before=3) is None  # all seen already
    got = add(means, prompt, 4, 10, before=1)
    assert_mean(got, prompt, LAYERS)


@pytest.mark.parametrize(("steps", "gap"), [([(2, 3)], "0..1"), ([(0, 3), (5, 3)], "3..4")])
def test_positions_served_from_the_prefix_cache_are_a_gap(
    steps: list[tuple[int, int]], gap: str
) -> None:
    prompt = Prompt("m", 8, torch.float32, seed=6)
    means = MeanPooling()
    *earlier, (nc, ns) = steps
    for before in earlier:
        add(means, prompt, *before)
    with pytest.raises(MeanGap, match=f"positions {gap} were served from the prefix cache"):
        add(means, prompt, nc, ns)
    means.forget(["m"])
    assert len(means) == 0


def test_requests_are_summed_apart_and_pruned_by_id() -> None:
    a = Prompt("a", 6, torch.float32, seed=7)
    b = Prompt("b", 6, torch.float32, seed=8)
    c = Prompt("c", 6, torch.float32, seed=9)
    means = MeanPooling()
    for prompt in (a, b, c):
        assert add(means, prompt, 0, 3) is None
    assert len(means) == 3
    means.keep_only({"a": object(), "b": object(), "unknown": object()})
    assert len(means) == 2
    means.forget({"b", "never-seen"})
    assert len(means) == 1
    assert_mean(add(means, a, 3, 3), a, LAYERS)
    # "c" was dropped: its next step starts past an empty sum.
    with pytest.raises(MeanGap):
        add(means, c, 3, 3)
