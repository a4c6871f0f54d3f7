"""The asynchronous device path, without a GPU: fake copies and events, a real ring.

A fake copier stands in for the device: its copies complete only when a test says so (as an
event would report), so these tests pin when vectors are published, under which key, in which
order, and what a failing copy costs (error records for exactly its keys). The real
:class:`AsyncRowCopier` runs on CPU tensors with fake events and unpinned buffers to check what
it copies and its buffer reuse.
"""

from __future__ import annotations

import gc
import logging
import struct
import weakref
from typing import Any

import pytest
import torch

from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import (
    CAPTURED,
    FINAL,
    HAS_V1,
    HIDDEN,
    MODEL,
    Batch,
    FakeRows,
    FakeV1Runner,
    assert_last_record,
    by_row,
    error_of,
    key,
    record_of,
    row_vector,
    sched,
    xargs,
)
from vllm_hidden_state_proxy.ring import RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook.capture import STEP_FAILED, StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import (
    AsyncRowCopier,
    HostBuffers,
    PendingRows,
    PinnedBufferPool,
    SyncRowCopier,
    copier_for,
    host_float32,
    stack_as_float32,
)
from vllm_hidden_state_proxy.worker_hook.publication_queue import COPY_FAILED
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView

# -- fakes ----------------------------------------------------------------------------------------


def float32_rows(rows: Any) -> list[bytes]:
    """The rows as little-endian float32 bytes each (what the copiers' buffer holds)."""
    array = host_float32(rows)
    return [array[i].tobytes() for i in range(array.shape[0])]


def rows_in(pending: PendingRows) -> list[bytes]:
    """A completed copy's buffer, cut into its rows."""
    data = bytes(pending.buffer())
    return [data[i : i + 4 * HIDDEN] for i in range(0, len(data), 4 * HIDDEN)]


class FakeCopier:
    """Copies for real (synchronously) but reports completion only as the test decides."""

    def __init__(self) -> None:
        self.started: list[FakeRows] = []

    def start(self, rows: Any) -> FakeRows:
        pending = FakeRows(float32_rows(rows))
        self.started.append(pending)
        return pending


class FakeAsyncOutput:
    """Stands in for vLLM's AsyncGPUModelRunnerOutput / AsyncOutput."""

    def __init__(self, on_get_output: Any = None) -> None:
        self.calls = 0
        self._on_get_output = on_get_output

    def get_output(self) -> str:
        self.calls += 1
        if self._on_get_output is not None:
            self._on_get_output()
        return "model-runner-output"


@pytest.fixture
def copier() -> FakeCopier:
    return FakeCopier()


@pytest.fixture
def capture(writer: RingWriter, copier: FakeCopier) -> StepCapture:
    return StepCapture(V1RunnerView(), writer, MODEL, captured=CAPTURED, copier=copier)


def step(capture: StepCapture, runner: FakeV1Runner, batch: Batch, **kw: Any) -> dict[str, int]:
    """One ``execute_model``: lay out the batch, then run the hook."""
    starts = runner.load(batch)
    capture.after_execute_model(runner, sched(batch, **kw))
    return starts


def errors(hook_log: HookLog) -> list[logging.LogRecord]:
    return [r for r in hook_log.records if r.levelno >= logging.ERROR]


# -- when vectors are published -------------------------------------------------------------------


def test_nothing_is_published_before_the_copy_completes(
    capture: StepCapture, copier: FakeCopier, writer: RingWriter, reader: RingReader
) -> None:
    runner = FakeV1Runner(torch.float16)
    starts = step(capture, runner, [("a", 5, 0, 5)], new={"a": key(1)})
    [pending] = copier.started
    assert writer.publish_count() == 0
    assert reader.lookup(key(1)) is None
    assert pending.waits == 0  # execute_model never waits for the device
    # A later execute_model polls: still running, still nothing.
    step(capture, runner, [("a", 5, 5, 1)])
    assert writer.publish_count() == 0
    pending.complete()
    step(capture, runner, [("a", 5, 6, 1)])
    assert_last_record(reader.lookup(key(1)), row=starts["a"] + 4, prompt_len=5)
    assert pending.released
    assert pending.waits == 0


def test_the_steps_output_publishes_before_vllms_get_output_runs(
    capture: StepCapture, copier: FakeCopier, writer: RingWriter, reader: RingReader
) -> None:
    runner = FakeV1Runner(torch.bfloat16)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    seen_by_vllm: list[bool] = []
    output = FakeAsyncOutput(lambda: seen_by_vllm.append(reader.lookup(key(1)) is not None))
    capture.after_sample_tokens(output)
    assert writer.publish_count() == 0  # sample_tokens returned without waiting
    assert copier.started[0].waits == 0
    assert output.get_output() == "model-runner-output"  # e.g. on vLLM's output thread
    assert seen_by_vllm == [True]
    assert_last_record(reader.lookup(key(1)), row=2, prompt_len=3)
    # The replacement took itself off: no cycle keeps the output (and its tensors) alive.
    assert "get_output" not in vars(output)
    gc.disable()
    try:
        freed = weakref.ref(output)
        del output
        assert freed() is None
    finally:
        gc.enable()


def test_get_output_waits_only_for_its_own_and_earlier_steps(
    capture: StepCapture, copier: FakeCopier, reader: RingReader
) -> None:
    runner = FakeV1Runner(torch.float16)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    output_1 = FakeAsyncOutput()
    capture.after_sample_tokens(output_1)
    # vLLM schedules step 2 before the output of step 1 is collected.
    step(capture, runner, [("a", 3, 3, 1), ("b", 4, 0, 4)], new={"b": key(2)})
    first, second = copier.started
    second.may_wait.clear()  # step 2's forward is still running: waiting on it would hang
    output_1.get_output()
    assert first.waits == 1 and second.waits == 0
    assert reader.lookup(key(1)) is not None
    assert reader.lookup(key(2)) is None
    output_2 = FakeAsyncOutput()
    capture.after_sample_tokens(output_2)
    second.may_wait.set()
    output_2.get_output()
    assert reader.lookup(key(2)) is not None


def test_an_output_without_get_output_publishes_before_sample_tokens_returns(
    capture: StepCapture, copier: FakeCopier, reader: RingReader
) -> None:
    """V1 without async scheduling: the stream was synchronized for the sampled tokens."""
    runner = FakeV1Runner(torch.float16)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    capture.after_sample_tokens(object())
    assert copier.started[0].waits == 1
    assert reader.lookup(key(1)) is not None


def test_sample_tokens_without_pending_copies_leaves_the_output_alone(
    capture: StepCapture,
) -> None:
    output = FakeAsyncOutput()
    original = output.get_output
    capture.after_sample_tokens(output)
    assert "get_output" not in vars(output)
    assert output.get_output == original
    StepCapture(V1RunnerView(), None, MODEL).after_sample_tokens(output)  # non-publishing rank
    assert "get_output" not in vars(output)


def test_several_pending_steps_publish_in_order_under_their_own_keys(
    capture: StepCapture,
    copier: FakeCopier,
    writer: RingWriter,
    reader: RingReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = FakeV1Runner(torch.float16)
    # Three steps, each computing a different request's last prompt token at a different row.
    s1 = step(capture, runner, [("x", 2, 0, 2), ("a", 3, 0, 3)], new={"x": None, "a": key(1)})
    s2 = step(capture, runner, [("b", 5, 0, 5), ("a", 3, 3, 1)], new={"b": key(2)})
    s3 = step(
        capture,
        runner,
        [("a", 3, 4, 1), ("c", 4, 2, 2), ("d", 2, 0, 2)],
        new={"c": key(3), "d": key(4)},
    )
    first, second, third = copier.started
    published: list[bytes] = []
    real_publish = writer.publish

    def recording_publish(k: bytes, vector: bytes, **kw: Any) -> None:
        published.append(k)
        real_publish(k, vector, **kw)

    monkeypatch.setattr(writer, "publish", recording_publish)
    # Later copies completing first are held back: the queue publishes oldest first.
    third.complete()
    second.complete()
    capture.after_execute_model(runner, sched([]))
    assert published == []
    first.complete()
    capture.after_execute_model(runner, sched([]))
    assert published == [key(1), key(2), key(3), key(4)]
    assert_last_record(reader.lookup(key(1)), row=s1["a"] + 2, prompt_len=3)
    assert_last_record(reader.lookup(key(2)), row=s2["b"] + 4, prompt_len=5)
    assert_last_record(reader.lookup(key(3)), row=s3["c"] + 1, prompt_len=4)
    assert_last_record(reader.lookup(key(4)), row=s3["d"] + 1, prompt_len=2)
    assert capture.publications is not None and len(capture.publications) == 0


def test_keys_are_fixed_when_the_copy_starts(
    capture: StepCapture, copier: FakeCopier, reader: RingReader
) -> None:
    """A request finishing (and its id being reused) before the copy completes changes nothing."""
    runner = FakeV1Runner(torch.float16)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    step(capture, runner, [("a", 4, 0, 4)], new={"a": key(2)}, finished=["a"])
    first, second = copier.started
    second.complete()
    first.complete()
    capture.after_execute_model(runner, sched([]))
    assert_last_record(reader.lookup(key(1)), row=2, prompt_len=3)
    assert_last_record(reader.lookup(key(2)), row=3, prompt_len=4)


def test_a_failing_copy_answers_only_its_keys_and_is_logged_once(
    capture: StepCapture,
    copier: FakeCopier,
    writer: RingWriter,
    reader: RingReader,
    hook_log: HookLog,
) -> None:
    runner = FakeV1Runner(torch.float16)
    step(capture, runner, [("a", 3, 0, 3), ("b", 2, 0, 2)], new={"a": key(1), "b": key(2)})
    step(capture, runner, [("c", 4, 0, 4)], new={"c": key(3)})
    step(capture, runner, [("d", 2, 0, 2)], new={"d": xargs(key(4), layers=[0, FINAL])})
    broken, fine, also_broken = copier.started
    broken.failure = RuntimeError("CUDA error: an illegal memory access")
    fine.complete()
    capture.after_execute_model(runner, sched([]))  # polls: raises inside done()
    assert capture.publications is not None and len(capture.publications) == 1
    also_broken.failure = RuntimeError("again")
    output = FakeAsyncOutput()
    capture.after_sample_tokens(output)
    assert output.get_output() == "model-runner-output"  # raises inside wait(): contained
    for k in (key(1), key(2), key(4)):
        assert error_of(reader.lookup(k)).message == COPY_FAILED
    assert_last_record(reader.lookup(key(3)), row=3, prompt_len=4)
    assert writer.publish_count() == 4
    [record] = errors(hook_log)
    assert record.exc_info is not None
    assert "copying" in record.getMessage()
    assert not broken.released and not also_broken.released  # their buffers are not reused
    assert fine.released
    # The failed keys are not captured again (e.g. after a preemption).
    step(capture, runner, [("a", 3, 0, 3)])
    assert len(copier.started) == 3


def test_a_copier_that_cannot_start_answers_the_steps_keys(
    writer: RingWriter, reader: RingReader, hook_log: HookLog
) -> None:
    class Broken:
        def start(self, rows: Any) -> Any:
            raise RuntimeError("cannot pin memory")

    capture = StepCapture(V1RunnerView(), writer, MODEL, captured=CAPTURED, copier=Broken())
    runner = FakeV1Runner(torch.float16)
    step(capture, runner, [("a", 3, 0, 3), ("b", 30, 0, 8)], new={"a": key(1), "b": key(2)})
    assert capture.selected.pending == {}
    assert error_of(reader.lookup(key(1))).message == STEP_FAILED
    assert error_of(reader.lookup(key(2))).message == STEP_FAILED  # its chunk was in the step
    assert writer.publish_count() == 2
    [record] = errors(hook_log)
    assert "capturing a step's hidden states" in record.getMessage()


def test_mean_vectors_go_through_the_same_queue(
    capture: StepCapture, copier: FakeCopier, reader: RingReader
) -> None:
    runner = FakeV1Runner(torch.float32)
    flag = xargs(key(1), layers=[2, FINAL], pooling="mean")
    step(capture, runner, [("m", 4, 0, 2)], new={"m": flag})
    assert copier.started == []  # half the prompt: no copy yet
    step(capture, runner, [("m", 4, 2, 2), ("l", 2, 0, 2)], new={"l": key(2)})
    [pending] = copier.started
    assert reader.lookup(key(1)) is None
    pending.complete()
    capture.after_execute_model(runner, sched([]))
    record = record_of(reader.lookup(key(1)))
    assert record.pooling == "mean"
    # by_row: the mean of rows 0, 1 (step 1) and 0, 1 (step 2) is row 0.5 of each layer.
    for layer in (2, FINAL):
        rows_0_1 = zip(by_row("", 0, 0, layer), by_row("", 1, 1, layer), strict=True)
        assert record.floats(layer) == [(a + b) / 2 for a, b in rows_0_1]
    assert_last_record(reader.lookup(key(2)), row=3, prompt_len=2)


# -- the CPU path ---------------------------------------------------------------------------------


def test_cpu_tensors_get_the_synchronous_copier() -> None:
    assert isinstance(copier_for(torch.device("cpu")), SyncRowCopier)
    assert isinstance(copier_for(torch.device("cuda", 0)), AsyncRowCopier)
    assert isinstance(copier_for(torch.device("meta")), AsyncRowCopier)


def test_cpu_path_publishes_before_execute_model_returns(
    writer: RingWriter, reader: RingReader
) -> None:
    # The copier is chosen from the tensors.
    capture = StepCapture(V1RunnerView(), writer, MODEL, captured=CAPTURED)
    runner = FakeV1Runner(torch.bfloat16)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    assert isinstance(capture.copier, SyncRowCopier)
    assert_last_record(reader.lookup(key(1)), row=2, prompt_len=3)
    assert capture.publications is not None and len(capture.publications) == 0
    output = FakeAsyncOutput()
    capture.after_sample_tokens(output)
    assert "get_output" not in vars(output)


def hidden(rows: int, dtype: torch.dtype = torch.bfloat16, layer: int = FINAL) -> torch.Tensor:
    """A step's ``[rows, HIDDEN]`` states of ``layer`` laid out as :func:`by_row`."""
    return torch.tensor([by_row("", r, r, layer) for r in range(rows)]).to(dtype)


def test_sync_copy_is_little_endian_float32_in_the_given_order() -> None:
    states = hidden(6)
    pending = SyncRowCopier().start([states[5], states[0], states[5]])
    assert pending.done()
    pending.wait()
    assert rows_in(pending) == [row_vector(5), row_vector(0), row_vector(5)]
    assert struct.unpack(f"<{HIDDEN}f", rows_in(pending)[1]) == (0.0, 0.25, 0.5, 0.75)
    pending.release()


def test_rows_of_different_dtypes_and_layers_stack_as_float32() -> None:
    last = hidden(3, torch.bfloat16)[2]
    aux = hidden(3, torch.float16, layer=0)[1]
    mean = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32)  # a pooled vector
    stacked = stack_as_float32([last, aux, mean])
    assert stacked.dtype == torch.float32
    assert stacked.shape == (3, HIDDEN)
    assert float32_rows([last, aux, mean]) == [
        row_vector(2),
        row_vector(1, 0),
        struct.pack(f"<{HIDDEN}f", 0.1, 0.2, 0.3, 0.4),
    ]
    assert stack_as_float32([last, last]).dtype == torch.float32


# -- AsyncRowCopier and its buffers, on CPU tensors with fake events -------------------------------


class FakeEvent:
    def __init__(self) -> None:
        self.recorded = False
        self.completed = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.completed = True


def unpinned(capacity: int, hidden_size: int) -> HostBuffers:
    return HostBuffers(rows=torch.empty((capacity, hidden_size), dtype=torch.float32))


@pytest.fixture
def events() -> list[FakeEvent]:
    return []


@pytest.fixture
def async_copier(events: list[FakeEvent]) -> AsyncRowCopier:
    def make_event(device: Any) -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    def record(event: FakeEvent, device: Any) -> None:
        event.recorded = True

    return AsyncRowCopier(PinnedBufferPool(unpinned, max_free=2), make_event, record)


def test_async_copier_reads_back_the_given_rows(
    async_copier: AsyncRowCopier, events: list[FakeEvent]
) -> None:
    states = hidden(6)
    aux = hidden(6, torch.float16, layer=0)
    pending = async_copier.start([states[5], states[0], aux[5], states[5]])
    [event] = events
    assert event.recorded
    assert not pending.done()
    with pytest.raises(RuntimeError, match="not completed"):
        rows_in(pending)
    event.completed = True
    assert pending.done()
    assert rows_in(pending) == [row_vector(5), row_vector(0), row_vector(5, 0), row_vector(5)]
    assert struct.unpack(f"<{HIDDEN}f", rows_in(pending)[1]) == (0.0, 0.25, 0.5, 0.75)


def test_the_stacked_rows_stay_referenced_until_release(
    async_copier: AsyncRowCopier, events: list[FakeEvent]
) -> None:
    pending = async_copier.start([hidden(2)[1]])
    kept = pending._device_tensors  # type: ignore[attr-defined]
    assert len(kept) == 1 and kept[0].dtype == torch.float32
    events[0].completed = True
    assert pending.done()
    pending.release()
    assert pending._device_tensors == ()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="released"):
        rows_in(pending)


def test_buffers_are_not_reused_while_their_copy_is_pending(
    async_copier: AsyncRowCopier, events: list[FakeEvent]
) -> None:
    pool = async_copier.pool
    states = hidden(4)
    first = async_copier.start([states[1]])
    second = async_copier.start([states[2]])
    buffers_of = [p._buffers for p in (first, second)]  # type: ignore[attr-defined]
    assert buffers_of[0] is not buffers_of[1]
    # Released before completion (e.g. a failed copy): the buffer is dropped, not pooled.
    second.release()
    assert pool.free_count == 0
    events[0].completed = True
    assert first.done()
    assert rows_in(first) == [row_vector(1)]
    first.release()
    assert pool.free_count == 1
    third = async_copier.start([states[3]])
    assert third._buffers is buffers_of[0]  # type: ignore[attr-defined]
    assert pool.free_count == 0
    third.wait()
    assert rows_in(third) == [row_vector(3)]


def test_pool_sizes_buffers_to_the_rows_and_keeps_a_few() -> None:
    made: list[tuple[int, int]] = []

    def allocate(capacity: int, hidden_size: int) -> HostBuffers:
        made.append((capacity, hidden_size))
        return unpinned(capacity, hidden_size)

    pool = PinnedBufferPool(allocate, max_free=2, min_rows=8)
    small, large, larger = pool.take(1, 4), pool.take(9, 4), pool.take(33, 4)
    assert made == [(8, 4), (16, 4), (64, 4)]
    assert (larger.capacity, larger.hidden_size) == (64, 4)
    for buffers in (small, large, larger):
        pool.release(buffers)
    assert pool.free_count == 2  # the smallest went
    assert pool.take(10, 4) is large  # the smallest that fits
    assert pool.take(3, 8).hidden_size == 8  # another width: a new buffer
    assert made[-1] == (8, 8)


def test_pool_takes_and_drops_any_free_buffer_not_only_the_first() -> None:
    """The free buffers are found by identity: taking (or dropping) one behind another in the
    free list compared their tensors once, which raised (found by tests/gpu's stress run)."""
    pool = PinnedBufferPool(unpinned, max_free=2, min_rows=8)
    large, small = pool.take(9, 4), pool.take(1, 4)
    pool.release(large)
    pool.release(small)
    assert pool.take(1, 4) is small  # behind `large` in the free list
    same_size = pool.take(9, 4)
    assert same_size is large
    other = pool.take(9, 4)  # a new one of the same size
    pool.release(other)
    pool.release(same_size)
    pool.release(small)  # three free: the smallest goes, from the end of the list
    assert pool.free_count == 2
    assert pool.take(9, 4) in (other, same_size)


# -- vLLM's outputs -------------------------------------------------------------------------------


def test_vllms_async_outputs_accept_a_shadowing_get_output() -> None:
    from vllm.v1.worker.gpu.async_utils import AsyncOutput

    classes: list[type] = [AsyncOutput]
    if HAS_V1:
        from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

        classes.append(AsyncGPUModelRunnerOutput)
    for cls in classes:
        output: Any = object.__new__(cls)
        output.get_output = lambda: "shadowed"
        assert output.get_output() == "shadowed"
