"""The hook's capture pipeline over a few hundred steps of a fake batch, on CPU and on CUDA.

:class:`~vllm_hidden_state_proxy.worker_hook.capture.StepCapture` reads a fake V2 runner
(``V2RunnerView``, the runner vLLM >= 0.34 has on GPU) through a few hundred steps of
:func:`~tests.gpu.scenario.pipeline_asks`: new, running, finished, preempted and resumed
requests, ``n`` of 1 to 3, every pooling (``last``, ``mean``, spans, ``all_prompt``,
``last_answer``, ``all_answer``), unflagged traffic between. Its records, read back from a real
ring, must be :func:`~tests.gpu.scenario.expected_records`: what the asks alone say they hold.

- ``cpu``: the synchronous copier (``SyncRowCopier``), as CI runs it;
- ``cuda-eager``: the asynchronous copier (pinned buffers, events), the device kept behind the
  host and two outputs uncollected, as vLLM's async scheduling does, so every copy is still in
  flight when the next steps overwrite the static hidden states; the records must also equal
  the CPU run's (copies to the bit, means within float32 rounding);
- ``cuda-graph``: the same with the forward captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.gpu.batch import Engine, FakeV2Runner
from tests.gpu.devices import device_of, needs_cuda
from tests.gpu.model import CAPTURED, MODEL, MatmulModel
from tests.gpu.scenario import (
    Read,
    check_records,
    check_same,
    expected_records,
    pipeline_asks,
    ring,
    simulate,
)
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import AsyncRowCopier, SyncRowCopier
from vllm_hidden_state_proxy.worker_hook.runners import V2RunnerView

HIDDEN = 64
SCHEDULE_EVENTS = (
    "preempted in its prompt",
    "preempted in its answer",
    "prefix-cache hit",
    "prompt chunk",
)
BUDGET = 32  # tokens a step: prompts of up to 40 are prefilled in chunks


def run_pipeline(directory: Path, device_name: str, *, graph: bool = False) -> dict[bytes, Read]:
    """The pipeline scenario on one device; its records, checked against the reference."""
    device = device_of(device_name)
    asks = pipeline_asks()
    seen: Counter[str] = Counter()
    steps = simulate(asks, budget=BUDGET, seen=seen)
    assert 200 <= len(steps) <= 400
    # What the schedule must hold for the test to mean something.
    for event in SCHEDULE_EVENTS:
        assert seen[event] >= 3, (event, seen)
    model = MatmulModel(device, tokens=BUDGET, hidden=HIDDEN, dtype=torch.bfloat16, graph=graph)
    wanted = expected_records(asks, model)
    directory.mkdir()
    with ring(directory, HIDDEN) as shared:
        capture = StepCapture(V2RunnerView(), shared.writer, MODEL, captured=CAPTURED)
        engine = Engine(FakeV2Runner(model), capture, lag=2, device_lag_us=3000)
        engine.run(steps)
        got = shared.read_back(wanted)
        # Each key exactly once: nothing published twice, nothing that was not wanted.
        assert shared.writer.publish_count() == len(wanted)
    check_records(got, wanted, HIDDEN)
    # Nothing left behind: no state, no reservation, no unpublished copy.
    assert capture.selected.pending == {}
    assert (len(capture.means), len(capture.spans), len(capture.matrices)) == (0, 0, 0)
    assert len(capture.answers) == 0
    assert capture.device.reserved == 0 and len(capture.budget) == 0
    assert capture.publications is not None and len(capture.publications) == 0
    if device.type == "cpu":
        assert isinstance(capture.copier, SyncRowCopier)
    else:
        assert isinstance(capture.copier, AsyncRowCopier)
        # The host ran ahead: outputs were collected while their copies were unpublished.
        assert engine.collected_unpublished > 0
    return got


def test_the_pipeline_on_cpu(tmp_path: Path) -> None:
    run_pipeline(tmp_path / "cpu", "cpu")


@needs_cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_pipeline_on_cuda_equals_the_cpu_run(tmp_path: Path, graph: bool) -> None:
    on_cpu = run_pipeline(tmp_path / "cpu", "cpu")
    on_cuda = run_pipeline(tmp_path / "cuda", "cuda", graph=graph)
    check_same(on_cpu, on_cuda, expected_records(pipeline_asks(), reference_model()))


def reference_model() -> MatmulModel:
    """The model's reference values need no device work: a CPU instance gives them."""
    return MatmulModel(torch.device("cpu"), tokens=1, hidden=HIDDEN, dtype=torch.bfloat16)
