"""The GPU check's figures: what the hook adds to a step, how fast a matrix reaches the host.

**A step** (:func:`step_figures`): ``tokens`` prompt tokens of bfloat16 hidden states (``T =
8192``, a typical ``max_num_batched_tokens``) shared by ``flagged`` requests whose prompts all
complete in the step, so each gets its record (pooling ``last``: one row; ``mean``: the sum of
its ``T / flagged`` rows, then that vector). The step's *forward* is one bfloat16 matmul
``[T, H] x [H, 12 H]``, a decoder layer's dense FLOPs (``24 T H**2``); a model's step runs one
such per layer, so the ratio to the whole forward is about ``added / (layers x forward)``.
The loop is vLLM V2's with async scheduling: the main thread enqueues step N (forward, then
the hook's ``after_execute_model``; the output's event on a copy stream, then the hook's
``after_sample_tokens``) while a second thread collects step N - 1's output (vLLM's output
thread: the hook publishes there), and the main thread waits for step N - 1's output before
step N + 1 (the engine's batch queue of two). Per step:

- ``forward ms``: the matmul's device time (CUDA events);
- ``host ms``: the main thread's time in ``after_execute_model`` (it delays the next launch);
- ``device ms``: the device time from the end of the forward to the end of the hook's work
  (gather, cast, copy to pinned memory); this includes the device waiting for the host when
  the host is the slower (many requests, ``mean``);
- ``added ms``: the loop's wall time per step with the hook, less without it (the steps are
  device-bound without it, so this is what the hook costs a step, all told).

**A matrix** (:func:`copy_figures`): a ``64 MiB`` float32 matrix (``[4096, 4096]``, from
bfloat16, an ``all_prompt`` of 4096 positions) through the hook's ``AsyncRowCopier`` (cast and
copy into pinned memory), beside a plain copy of a float32 tensor into pinned memory, a
``.cpu()`` into pageable memory, and the whole record (copy, then the ring's write with its CRC);
each against the forward that computed those positions (``[4096, 4096] x [4096, 49152]``).

On CPU (``--device cpu --smoke``) the same code runs with tiny sizes: the synchronous copier, no
events; its figures only show that the script runs.
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.gpu.batch import (
    FakeExecuteModelState,
    FakeInputBatch,
    FakeNewRequestData,
    FakeRequestStates,
    FakeSamplingParams,
    FakeSchedulerOutput,
    StepOutput,
    _Array,
)
from vllm_hidden_state_proxy.protocol import LAYERS_ENTRY, POOLING_ENTRY, REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import RingWriter
from vllm_hidden_state_proxy.ring.records import matrix_bytes
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import AsyncRowCopier, copier_for
from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers
from vllm_hidden_state_proxy.worker_hook.publication_queue import PublicationQueue, RecordTarget
from vllm_hidden_state_proxy.worker_hook.runners import V2RunnerView

FINAL = 1
LAYERS = CapturedLayers(FINAL, (FINAL,))
WIDTH = 12  # the forward's matmul: [T, H] x [H, WIDTH * H]


@dataclass(frozen=True)
class Sizes:
    hiddens: tuple[int, ...] = (4096, 8192)
    flagged: tuple[int, ...] = (1, 64, 1024)
    poolings: tuple[str, ...] = ("last", "mean")
    tokens: int = 8192
    steps: int = 20
    warmup: int = 3
    matrix_mib: int = 64
    matrix_hidden: int = 4096
    repeats: int = 5


FULL = Sizes()
#: ``--smoke``: the same code on tiny sizes, in seconds on a CPU (its figures mean nothing).
SMOKE = Sizes(
    hiddens=(64, 128),
    flagged=(1, 4, 16),
    tokens=64,
    steps=3,
    warmup=1,
    matrix_mib=1,
    matrix_hidden=64,
    repeats=2,
)


@dataclass(frozen=True)
class StepFigure:
    hidden: int
    pooling: str
    flagged: int
    tokens: int
    forward_ms: float
    host_ms: float
    device_ms: float | None
    added_ms: float

    @property
    def ratio(self) -> float:
        return self.added_ms / self.forward_ms if self.forward_ms > 0 else float("nan")


@dataclass(frozen=True)
class CopyFigure:
    path: str
    mib: float
    ms: float
    forward_ms: float

    @property
    def gib_per_s(self) -> float:
        return self.mib / 1024 / (self.ms / 1000) if self.ms > 0 else float("nan")


def _ring_dir() -> str:
    shm = Path("/dev/shm")
    return tempfile.mkdtemp(prefix="hsp-gpu-check-", dir=shm if shm.is_dir() else None)


@contextmanager
def _writer(hidden: int, *, slots: int, arena_mib: int = 0) -> Iterator[RingWriter]:
    writer = RingWriter.create(
        _ring_dir(),
        hidden_size=hidden,
        model="gpu-check",
        slot_count=slots,
        instance=0x4943,
        num_hidden_layers=FINAL,
        arena_size=arena_mib << 20,
    )
    try:
        yield writer
    finally:
        writer.close()
        for leftover in writer.path.parent.iterdir():
            leftover.unlink()
        writer.path.parent.rmdir()


class _Timer:
    """Device time between two points of the current stream (``None`` on CPU)."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: Any, end: Any) -> None:
        if self.cuda:
            self.pairs.append((start, end))

    def mean_ms(self) -> float | None:
        if not self.cuda or not self.pairs:
            return None
        torch.cuda.synchronize()
        return float(sum(a.elapsed_time(b) for a, b in self.pairs)) / len(self.pairs)


def _synchronize(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Steps:
    """Prebuilt steps of ``flagged`` requests sharing ``tokens`` prompt tokens, all complete."""

    def __init__(self, count: int, flagged: int, tokens: int, pooling: str) -> None:
        self.outputs: list[FakeSchedulerOutput] = []
        self.batches: list[FakeInputBatch] = []
        per = [tokens // flagged + (i < tokens % flagged) for i in range(flagged)]
        starts = np.concatenate([[0], np.cumsum(per)]).astype(np.int32)
        self.prompt_len = np.array(per, dtype=np.int32)
        previous: list[str] = []
        for step in range(count):
            ids = [f"s{step}-r{i}" for i in range(flagged)]
            new = [
                FakeNewRequestData(
                    req_id,
                    [],
                    FakeSamplingParams(
                        {
                            REQUEST_KEY_ENTRY: (step * 100_000 + i + 1).to_bytes(16, "big").hex(),
                            LAYERS_ENTRY: [FINAL],
                            POOLING_ENTRY: pooling,
                        },
                        1,
                    ),
                    0,
                )
                for i, req_id in enumerate(ids)
            ]
            scheduled = dict(zip(ids, per, strict=True))
            self.outputs.append(FakeSchedulerOutput(new, scheduled, tokens, set(previous)))
            self.batches.append(
                FakeInputBatch(
                    ids,
                    flagged,
                    np.arange(flagged, dtype=np.int32),
                    starts,
                    np.zeros(flagged, dtype=np.int32),
                    self.prompt_len,
                )
            )
            previous = ids


class _BenchRunner:
    """The V2 runner's state for :class:`_Steps` (the prompt lengths never change)."""

    def __init__(self, prompt_len: np.ndarray[Any, Any]) -> None:
        self.req_states = FakeRequestStates(_Array(prompt_len))
        self.execute_model_state: FakeExecuteModelState | None = None


def _loop(
    device: Any,
    sizes: Sizes,
    x: Any,
    weights: Any,
    scratch: Any,
    hidden_states: Any,
    steps: _Steps,
    capture: StepCapture | None,
) -> tuple[float, float, float | None, float | None]:
    """(wall ms, hook host ms, hook device ms, forward device ms) per timed step."""
    runner = _BenchRunner(steps.prompt_len)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    hook, forward = _Timer(device), _Timer(device)
    host = 0.0
    pending: deque[Future[str]] = deque()
    hidden = hidden_states.shape[1]
    with ThreadPoolExecutor(1, thread_name_prefix="output") as output_thread:
        started = 0.0
        for number in range(sizes.warmup + sizes.steps):
            timed = number >= sizes.warmup
            if number == sizes.warmup:
                while pending:
                    pending.popleft().result()
                _synchronize(device)
                started = time.perf_counter()
            begin = forward.mark()
            torch.mm(x, weights, out=scratch)
            hidden_states.copy_(scratch[:, :hidden])
            end = forward.mark()
            if timed:
                forward.add(begin, end)
            runner.execute_model_state = FakeExecuteModelState(
                steps.batches[number], hidden_states, None
            )
            if capture is not None:
                clock = time.perf_counter()
                capture.after_execute_model(runner, steps.outputs[number])
                if timed:
                    host += time.perf_counter() - clock
                    hook.add(end, hook.mark())
            runner.execute_model_state = None
            output = StepOutput(device, copy_stream)
            if capture is not None:
                capture.after_sample_tokens(output)
            pending.append(output_thread.submit(output.get_output))
            while len(pending) > 1:  # the engine waits for step N - 1 before step N + 1
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        _synchronize(device)
        wall = (time.perf_counter() - started) * 1000 / sizes.steps
    return wall, host * 1000 / sizes.steps, hook.mean_ms(), forward.mean_ms()


def step_figures(device: Any, sizes: Sizes = FULL) -> list[StepFigure]:
    figures = []
    for hidden in sizes.hiddens:
        tokens = sizes.tokens
        x = torch.randn((tokens, hidden), device=device).to(torch.bfloat16)
        weights = (torch.randn((hidden, WIDTH * hidden), device=device) / hidden**0.5).to(
            torch.bfloat16
        )
        scratch = torch.empty((tokens, WIDTH * hidden), dtype=torch.bfloat16, device=device)
        hidden_states = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
        for pooling in sizes.poolings:
            for flagged in sizes.flagged:
                count = sizes.warmup + sizes.steps
                steps = _Steps(count, flagged, tokens, pooling)
                base_wall, _, _, forward_ms = _loop(
                    device, sizes, x, weights, scratch, hidden_states, steps, None
                )
                with _writer(hidden, slots=max(64, 2 * flagged)) as writer:
                    capture = StepCapture(V2RunnerView(), writer, "gpu-check", captured=LAYERS)
                    wall, host_ms, device_ms, _ = _loop(
                        device, sizes, x, weights, scratch, hidden_states, steps, capture
                    )
                    published = writer.publish_count()
                if published != count * flagged:
                    raise AssertionError(f"{published} records of {count * flagged}")
                figures.append(
                    StepFigure(
                        hidden,
                        pooling,
                        flagged,
                        tokens,
                        base_wall if forward_ms is None else forward_ms,
                        host_ms,
                        device_ms,
                        wall - base_wall,
                    )
                )
        del x, weights, scratch, hidden_states
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return figures


def _time_ms(device: Any, repeats: int, run: Any) -> float:
    run()  # warm-up: buffers, kernels
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, (time.perf_counter() - started) * 1000)
    return best


def copy_figures(device: Any, sizes: Sizes = FULL) -> list[CopyFigure]:
    hidden = sizes.matrix_hidden
    rows = (sizes.matrix_mib << 20) // (4 * hidden)
    mib = matrix_bytes(rows, 1, hidden) / (1 << 20)
    source = torch.randn((rows, hidden), device=device).to(torch.bfloat16)
    source32 = source.float()
    weights = torch.randn((hidden, WIDTH * hidden), device=device).to(torch.bfloat16)
    scratch = torch.empty((rows, WIDTH * hidden), dtype=torch.bfloat16, device=device)
    forward_ms = _time_ms(device, sizes.repeats, lambda: torch.mm(source, weights, out=scratch))
    copier = copier_for(device)

    def through_copier() -> None:
        pending = copier.start(source)
        pending.wait()
        pending.release()

    name = "AsyncRowCopier (cast, pinned)"
    if not isinstance(copier, AsyncRowCopier):
        name = "SyncRowCopier (CPU)"
    ms = _time_ms(device, sizes.repeats, through_copier)
    figures = [CopyFigure(name, mib, ms, forward_ms)]
    if device.type == "cuda":
        pinned = torch.empty((rows, hidden), dtype=torch.float32, pin_memory=True)
        ms = _time_ms(device, sizes.repeats, lambda: pinned.copy_(source32, non_blocking=True))
        figures.append(CopyFigure("plain copy into pinned", mib, ms, forward_ms))
    ms = _time_ms(device, sizes.repeats, lambda: source32.to("cpu", copy=True))
    figures.append(CopyFigure(".cpu() into pageable", mib, ms, forward_ms))
    with _writer(hidden, slots=8, arena_mib=4 * sizes.matrix_mib) as writer:
        queue = PublicationQueue(writer, _raise)

        def record() -> None:
            region = writer.space.reserve(matrix_bytes(rows, 1, hidden))
            target = RecordTarget(
                b"\x49" * 16, 0, rows, (FINAL,), pooling="all_prompt", rows=rows, region=region
            )
            queue.publish_through(queue.add(copier.start(source), [target]))

        ms = _time_ms(device, sizes.repeats, record)
    figures.append(CopyFigure("record: copier + ring write", mib, ms, forward_ms))
    return figures


def _raise(where: str) -> None:
    raise RuntimeError(f"the publication failed: {where}")


def step_table(figures: Sequence[StepFigure]) -> list[str]:
    lines = [
        " hidden  pooling  flagged  forward ms  host ms  device ms  added ms  added/forward",
    ]
    for f in figures:
        device = "-" if f.device_ms is None else f"{f.device_ms:9.3f}"
        lines.append(
            f" {f.hidden:6d}  {f.pooling:7s}  {f.flagged:7d}  {f.forward_ms:10.3f}  "
            f"{f.host_ms:7.3f}  {device:>9s}  {f.added_ms:8.3f}  {100 * f.ratio:12.1f} %"
        )
    return lines


def copy_table(figures: Sequence[CopyFigure]) -> list[str]:
    lines = [" path                            MiB      ms    GiB/s  vs forward"]
    for f in figures:
        lines.append(
            f" {f.path:30s} {f.mib:5.0f} {f.ms:7.2f} {f.gib_per_s:8.2f} "
            f"{f.ms / f.forward_ms if f.forward_ms > 0 else float('nan'):10.2f} x"
        )
    return lines


def as_json(steps: Sequence[StepFigure], copies: Sequence[CopyFigure]) -> dict[str, Any]:
    return {
        "steps": [{**asdict(f), "ratio": f.ratio} for f in steps],
        "copies": [{**asdict(f), "gib_per_s": f.gib_per_s} for f in copies],
    }
