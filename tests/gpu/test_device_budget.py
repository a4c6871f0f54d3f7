"""What the hook keeps on the device across steps, counted against HIDDEN_STATE_PROXY_DEVICE_MIB.

``all_prompt`` rows so far, ``spans`` sums, the answers' kept rows: each request is counted at
its most (float32) when first seen, against the limit that ``HookSettings`` reads from
``HIDDEN_STATE_PROXY_DEVICE_MIB`` (1 MiB here): past it, one request alone is a 413, the
requests in flight together a 503 (``matrix_budget.DeviceBudget``). Here, on CPU and on CUDA
alike: the same refusals, the same counts step by step, what is really kept never more than what
is counted, and on CUDA the device's allocated memory, at each step's end, never above the
count, and back to where it was once every request has finished.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.batch import Engine, FakeV2Runner, NewRequest, Scheduled, Step, most_tokens
from tests.gpu.devices import DEVICES, device_of, synchronize
from tests.gpu.model import CAPTURED, FINAL, MODEL, MatmulModel
from tests.gpu.scenario import Ask, ExpectedError, check_records, expected_records, key, ring
from vllm_hidden_state_proxy.protocol import ANSWER_WINDOW, DEVICE_MIB_ENV
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.runners import V2RunnerView
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

HIDDEN = 1024
KIB = 1024
#: One position of every captured layer (0, 2, 4), counted in float32.
ROW3 = 3 * HIDDEN * 4
ALL = (0, 2, FINAL)

# What each request keeps at its most (what the budget counts):
A = Ask("A", 40, "all_prompt", key(1), ALL)  # 40 x 12 KiB = 480 KiB, over 3 steps
B = Ask("B", 24, "spans", key(2), (FINAL,), spans=((0, 8), (8, 24)))  # sums + a running sum
C = Ask("C", 4, "last_answer", key(3), ALL, max_tokens=6)  # 9 positions x 12 KiB
D = Ask("D", 4, "all_answer", key(4), (0, FINAL), max_tokens=30)  # 30 x 8 KiB = 240 KiB
E = Ask("E", 8, "all_prompt", key(5), ALL)  # 96 KiB: more than what is left -> 503
F = Ask("F", 100, "all_prompt", key(6), ALL)  # 1200 KiB: more than the limit alone -> 413
G = Ask("G", 8, "all_prompt", key(7), ALL)  # 96 KiB once A and B have gone: fits
COUNTED = {
    "A": 40 * ROW3,
    "B": 2 * HIDDEN * 4 + (24 + 1) * HIDDEN * 4,
    "C": (ANSWER_WINDOW + 1) * ROW3,
    "D": 30 * 2 * HIDDEN * 4,
}


def budget_steps() -> list[Step]:
    """A, C and D in flight (828 KiB of 1 MiB); B arrives (936), then E (would be 1032: 503) and
    F (413); A and B complete their prompts (their matrices go to the copy: 348); G fits; C
    finishes after 6 tokens, D after 30."""

    def new(*asks: Ask) -> dict[str, NewRequest]:
        return {a.name: NewRequest(a.extra_args(), a.max_tokens) for a in asks}

    def prompt(ask: Ask, computed: int, scheduled: int) -> Scheduled:
        return Scheduled(ask.name, ask.prompt_len, computed, scheduled, ask.name)

    def decode(ask: Ask, outputs: int) -> Scheduled:
        return Scheduled(ask.name, ask.prompt_len, ask.prompt_len + outputs - 1, 1, ask.name)

    steps = [
        Step([prompt(C, 0, 4), prompt(D, 0, 4), prompt(A, 0, 16)], new(A, C, D)),
        Step(
            [
                decode(C, 1),
                decode(D, 1),
                prompt(A, 16, 16),
                prompt(B, 0, 8),
                prompt(E, 0, 8),
                prompt(F, 0, 8),
            ],
            new(B, E, F),
        ),
        Step([decode(C, 2), decode(D, 2), prompt(A, 32, 8), prompt(B, 8, 16), prompt(F, 8, 8)]),
        Step([decode(C, 3), decode(D, 3), prompt(G, 0, 8)], new(G), finished=["A", "B", "E", "F"]),
    ]
    for outputs in range(4, D.max_tokens):
        batch = [decode(D, outputs)] + ([decode(C, outputs)] if outputs < C.max_tokens else [])
        steps.append(Step(batch, finished=["G"] if outputs == 4 else []))
    steps.append(Step([], finished=["C"]))  # C sampled its 6th token with D's 6th
    steps.append(Step([], finished=["D"]))
    return steps


def counted_after(step: int) -> int:
    """What the budget must count once ``step`` has run."""
    if step == 0:
        return COUNTED["A"] + COUNTED["C"] + COUNTED["D"]
    if step == 1:
        return COUNTED["A"] + COUNTED["B"] + COUNTED["C"] + COUNTED["D"]
    if step < len(budget_steps()) - 2:  # A's and B's matrices went to the copy, G's at once
        return COUNTED["C"] + COUNTED["D"]
    if step == len(budget_steps()) - 2:
        return COUNTED["D"]
    return 0


def kept_bytes(capture: StepCapture) -> int:
    """The bytes of the tensors the capture keeps across steps (what the budget counts for)."""

    def size(tensor: Any) -> int:
        return int(tensor.numel() * tensor.element_size())

    total = 0
    for sums in capture.spans._state.values():
        total += size(sums.total) + size(sums.starts) + size(sums.ends)
    for parts in capture.matrices._state.values():
        total += sum(size(part) for part in parts.parts)
    for answer in capture.answers._answers.values():
        total += sum(size(rows) for rows in answer.rows.values())
    return total


@pytest.mark.parametrize("device_name", DEVICES)
def test_kept_device_memory_is_counted_against_the_limit(tmp_path: Path, device_name: str) -> None:
    device = device_of(device_name)
    limit = HookSettings({DEVICE_MIB_ENV: "1"}).device_bytes
    assert limit == 1 << 20
    steps = budget_steps()
    model = MatmulModel(device, tokens=most_tokens(steps), hidden=HIDDEN, dtype=torch.bfloat16)
    wanted = expected_records([A, B, C, D, E, F, G], model)
    wanted[E.key] = ExpectedError(503, f"{DEVICE_MIB_ENV}=1 MiB")
    wanted[F.key] = ExpectedError(413, f"{DEVICE_MIB_ENV}=1 ")
    with ring(tmp_path, HIDDEN) as shared:
        capture = StepCapture(
            V2RunnerView(), shared.writer, MODEL, captured=CAPTURED, device_limit=limit
        )
        engine = Engine(FakeV2Runner(model), capture, lag=0)
        model.forward([0] * model.tokens)  # cuBLAS's workspace is the model's, not the hook's
        synchronize(device)
        baseline = allocated(device)
        for number, step in enumerate(steps):
            engine.step(step)
            engine.finish()  # every copy published: what is left is kept across steps
            if device.type == "cuda":
                synchronize(device)
                gc.collect()  # a tensor only a reference cycle holds is not the hook's
            assert capture.device.reserved == counted_after(number), number
            assert kept_bytes(capture) <= capture.device.reserved <= limit, number
            if device.type == "cuda":
                assert allocated(device) - baseline <= capture.device.reserved, number
        got = shared.read_back(wanted)
    check_records(got, wanted, HIDDEN)
    assert kept_bytes(capture) == 0 and len(capture.device) == 0
    if device.type == "cuda":
        gc.collect()
        assert allocated(device) == baseline


def allocated(device: Any) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0
