"""publication_queue.PublicationQueue: started copies -> ring records, in order, on two threads.

Copies are :class:`~tests.worker_hook.fakes.FakeRows` that complete when a test says so; the
records land in a real ring. What the capture puts into the queue, and when it drains it, is
tested in ``test_device_copy.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.worker_hook.fakes import (
    CAPTURED,
    FINAL,
    HIDDEN,
    MODEL,
    FakeRows,
    error_of,
    key,
    record_of,
    row_vector,
)
from vllm_hidden_state_proxy.ring import RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook.device_copy import SyncRowCopier
from vllm_hidden_state_proxy.worker_hook.publication_queue import (
    COPY_FAILED,
    PUBLISH_FAILED,
    PublicationQueue,
    RecordTarget,
)


def target(n: int, layers: tuple[int, ...] = (FINAL,), pooling: str = "last") -> RecordTarget:
    return RecordTarget(key(n), position=n, num_prompt_tokens=n + 1, layers=layers, pooling=pooling)


class UnreadableRows(FakeRows):
    def buffer(self) -> memoryview:
        raise RuntimeError("unreadable")


def done(vectors: list[bytes]) -> FakeRows:
    rows = FakeRows(vectors)
    rows.complete()
    return rows


@pytest.fixture
def on_error() -> list[str]:
    return []


@pytest.fixture
def queue(writer: RingWriter, on_error: list[str]) -> PublicationQueue:
    return PublicationQueue(writer, on_error.append)


def test_records_carry_their_targets_layers_position_and_pooling(
    queue: PublicationQueue, reader: RingReader, on_error: list[str]
) -> None:
    vectors = [row_vector(1, 0), row_vector(1, 2), row_vector(1, FINAL), row_vector(7, 2)]
    number = queue.add(done(vectors), [target(1, (0, 2, FINAL)), target(2, (2,), pooling="mean")])
    assert number == queue.last_number == 1
    first = record_of(reader.lookup(key(1)))
    assert first.layers == (0, 2, FINAL)
    assert first.vectors == b"".join(vectors[:3])
    assert (first.position, first.num_prompt_tokens, first.pooling) == (1, 2, "last")
    second = record_of(reader.lookup(key(2)))
    assert second.layers == (2,)
    assert second.vector(2) == row_vector(7, 2)
    assert (second.position, second.num_prompt_tokens, second.pooling) == (2, 3, "mean")
    assert on_error == []
    assert len(queue) == 0


def test_entries_are_published_oldest_first_and_only_once_complete(
    queue: PublicationQueue, writer: RingWriter, reader: RingReader
) -> None:
    first, second = FakeRows([row_vector(1)]), FakeRows([row_vector(2)])
    queue.add(first, [target(1)])
    queue.add(second, [target(2)])
    second.complete()
    queue.publish_ready()  # the oldest is not done: nothing goes out, nothing waits
    assert writer.publish_count() == 0
    assert first.waits == 0 and second.waits == 0
    first.complete()
    queue.publish_ready()
    assert writer.publish_count() == 2
    assert record_of(reader.lookup(key(1))).vector(FINAL) == row_vector(1)
    assert record_of(reader.lookup(key(2))).vector(FINAL) == row_vector(2)
    assert first.released and second.released
    assert len(queue) == 0


def test_publish_through_waits_for_entries_up_to_its_number_only(
    queue: PublicationQueue, writer: RingWriter
) -> None:
    started = [FakeRows([row_vector(i)]) for i in range(3)]
    numbers = [queue.add(rows, [target(i + 1)]) for i, rows in enumerate(started)]
    started[2].may_wait.clear()  # the newest copy is still running: waiting would hang
    queue.publish_through(numbers[1])
    assert [rows.waits for rows in started] == [1, 1, 0]
    assert writer.publish_count() == 2
    assert len(queue) == 1
    started[2].may_wait.set()
    queue.publish_through(numbers[2])
    assert writer.publish_count() == 3


def test_too_many_unpublished_steps_wait_for_the_oldest(
    writer: RingWriter, reader: RingReader
) -> None:
    queue = PublicationQueue(writer, lambda where: None, max_entries=2)
    started = [FakeRows([row_vector(i)]) for i in range(3)]
    for i, rows in enumerate(started):
        queue.add(rows, [target(i + 1)])
    assert [r.waits for r in started] == [1, 0, 0]
    assert len(queue) == 2
    assert record_of(reader.lookup(key(1))).vector(FINAL) == row_vector(0)


def test_polling_never_waits_for_another_thread_draining(writer: RingWriter) -> None:
    """The output thread may wait on a copy; the main thread's poll must not wait behind it."""
    queue = PublicationQueue(writer, lambda where: None)
    rows = FakeRows([row_vector(0)])
    rows.may_wait.clear()
    queue.add(rows, [target(1)])
    output_thread = threading.Thread(target=queue.publish_through, args=(queue.last_number,))
    output_thread.start()
    try:
        assert rows.waiting.wait(timeout=30)  # the output thread holds the drain lock now
        rows.complete()  # even a completed copy is left to the draining thread
        queue.publish_ready()  # returns at once although the drain lock is taken
        assert writer.publish_count() == 0
    finally:
        rows.may_wait.set()
        output_thread.join(timeout=30)
    assert not output_thread.is_alive()
    assert writer.publish_count() == 1


@pytest.mark.parametrize("where", ["done", "wait", "vectors"])
def test_a_failed_copy_answers_exactly_its_keys_with_error_records(
    queue: PublicationQueue,
    writer: RingWriter,
    reader: RingReader,
    on_error: list[str],
    where: str,
) -> None:
    broken = (UnreadableRows if where == "vectors" else FakeRows)([row_vector(1), row_vector(2)])
    fine = done([row_vector(3)])
    if where == "vectors":
        broken.complete()
    else:
        broken.failure = RuntimeError("CUDA error: an illegal memory access")
    queue.add(broken, [target(1), target(2, (0,))])
    queue.add(fine, [target(3)])
    if where == "wait":
        queue.publish_through(queue.last_number)
    else:
        queue.publish_ready()
    assert error_of(reader.lookup(key(1))).message == COPY_FAILED
    assert error_of(reader.lookup(key(2))).message == COPY_FAILED
    assert record_of(reader.lookup(key(3))).vector(FINAL) == row_vector(3)
    assert writer.publish_count() == 3
    assert on_error == ["copying a step's hidden states to the host"]
    assert not broken.released  # its host buffers are not reused
    assert fine.released
    assert len(queue) == 0


def test_rows_that_do_not_match_their_targets_are_answered_with_error_records(
    queue: PublicationQueue, reader: RingReader, on_error: list[str]
) -> None:
    # Two layers wanted, one row copied.
    queue.add(done([row_vector(1)]), [target(1, (0, FINAL))])
    assert error_of(reader.lookup(key(1))).message == COPY_FAILED
    assert on_error == ["matching copied rows to their keys"]


def test_a_bad_record_costs_only_itself_and_is_answered(
    queue: PublicationQueue, reader: RingReader, on_error: list[str]
) -> None:
    not_captured = next(layer for layer in range(FINAL) if layer not in CAPTURED.layers)
    queue.add(done([row_vector(1), row_vector(2)]), [target(1, (not_captured,)), target(2)])
    assert error_of(reader.lookup(key(1))).message == PUBLISH_FAILED
    assert record_of(reader.lookup(key(2))).vector(FINAL) == row_vector(2)
    assert on_error == ["publishing a hidden state to the ring"]


def test_publish_errors_survives_a_failing_writer(on_error: list[str]) -> None:
    class ClosedWriter:
        def __init__(self) -> None:
            self.keys: list[bytes] = []

        def publish_error(self, k: bytes, message: str) -> None:
            self.keys.append(k)
            raise ValueError("ring writer is closed")

    closed = ClosedWriter()
    PublicationQueue(closed, on_error.append).publish_errors([target(1), target(2)], "why")
    assert closed.keys == [key(1), key(2)]
    assert on_error == ["publishing an error record to the ring"] * 2


def test_a_matrix_goes_to_the_ring_as_one_contiguous_buffer(tmp_path: Path) -> None:
    """Issue #36: the host copy is one buffer (a view of the float32 tensor on CPU, no bytes
    per row), and each record the writer gets is a slice of it, copied once into the ring."""
    rows = 7
    matrix = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN)
    pending = SyncRowCopier().start(matrix)
    buffer = pending.buffer()
    assert buffer.contiguous and buffer.nbytes == rows * HIDDEN * 4
    assert np.shares_memory(np.frombuffer(buffer, np.uint8), matrix.numpy())

    with (
        RingWriter.create(
            tmp_path,
            hidden_size=HIDDEN,
            model=MODEL,
            slot_count=8,
            num_hidden_layers=CAPTURED.num_hidden_layers,
            layers=CAPTURED.layers,
            arena_size=1 << 16,
        ) as writer,
        RingReader.open(writer.path) as reader,
    ):
        given: list[object] = []
        publish = writer.publish

        def recording(key: bytes, vectors: bytes | memoryview, **kw: Any) -> None:
            given.append(vectors)
            publish(key, vectors, **kw)

        writer.publish = recording  # type: ignore[method-assign]
        targets = [  # 3 positions of 2 layers, then a vector: the matrix's 7 rows
            RecordTarget(key(1), 0, 3, (0, FINAL), "all_prompt", 3),
            RecordTarget(key(2), 0, 1, (2,), "last"),
        ]
        PublicationQueue(writer, pytest.fail).add(SyncRowCopier().start(matrix), targets)
        assert len(given) == 2 and all(isinstance(vectors, memoryview) for vectors in given)
        found = record_of(reader.lookup(key(1)))
        assert found.vector(0) == matrix[:3].numpy().tobytes()
        assert found.vector(FINAL) == matrix[3:6].numpy().tobytes()
        assert record_of(reader.lookup(key(2))).vector(2) == matrix[6].numpy().tobytes()
