"""Started host copies waiting to be published to the ring, oldest first.

Each entry pairs one step's :class:`~.device_copy.PendingRows` with the record each row becomes
(key, position, prompt length), fixed when the copy was started: a vector can only be published
under the key of the row it was copied from, whenever and on whichever thread it is published.

Two threads drain the queue: the worker's main thread (:meth:`publish_ready`, which never waits
for the device) and the thread that forwards a step's output to the engine
(:meth:`publish_through`, which waits for the copies of that step and earlier ones). Entries are
published in the order they were added, one drainer at a time.

A failing entry (the copy, or reading it back) is logged once through ``on_error`` and its keys
get error records (the proxy answers them at once with the reason); the other entries are
unaffected, and its host buffers are not reused. So does a record the ring refuses: its key
gets an error record, the entry's other records go out.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.worker_hook.device_copy import PendingRows

#: The error record of a request whose copy to the host failed.
COPY_FAILED = "copying the hidden states to the host failed in the vLLM worker (see vLLM's log)"
#: The error record of a request whose record could not be written to the ring.
PUBLISH_FAILED = "writing the hidden states to the ring failed in the vLLM worker (see vLLM's log)"


@dataclass(frozen=True, slots=True)
class RecordTarget:
    """What the next ``len(layers) * rows`` copied rows are published as: one record (a
    matrix's rows layer after layer, position after position)."""

    key: bytes
    position: int
    num_prompt_tokens: int
    layers: tuple[int, ...]
    pooling: str = "last"
    rows: int = 1
    #: A matrix's region of the ring's arena, reserved when its request was first seen
    #: (:mod:`.matrix_budget`); the writer writes it, or it is given back.
    region: int | None = None

    @property
    def row_count(self) -> int:
        """The copied rows this record takes."""
        return len(self.layers) * self.rows


@dataclass(frozen=True, slots=True)
class _Entry:
    number: int
    rows: PendingRows
    targets: list[RecordTarget]


class PublicationQueue:
    def __init__(
        self,
        writer: Any,
        on_error: Callable[[str], None],
        *,
        max_entries: int = 8,
    ) -> None:
        self._writer = writer
        self._on_error = on_error
        self._max_entries = max_entries
        self._entries: deque[_Entry] = deque()
        self._last_number = 0
        self._entries_lock = threading.Lock()  # guards _entries and _last_number; held briefly
        self._drain_lock = threading.Lock()  # one drainer at a time, so entries go out in order

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def last_number(self) -> int:
        """Number of the newest entry added so far (0 before the first)."""
        return self._last_number

    def add(self, rows: PendingRows, targets: list[RecordTarget]) -> int:
        """Queue a started copy; returns its number. Publishes at once what is already done.

        Safeguard: beyond ``max_entries`` unpublished entries (vLLM's output path should drain
        them every step), the oldest are waited for here.
        """
        with self._entries_lock:
            self._last_number += 1
            number = self._last_number
            self._entries.append(_Entry(number, rows, targets))
            overflow = len(self._entries) - self._max_entries
            force_through = self._entries[overflow - 1].number if overflow > 0 else 0
        if force_through:
            self.publish_through(force_through)
        self.publish_ready()
        return number

    def publish_ready(self) -> None:
        """Publish the oldest entries whose copy has completed. Never waits."""
        if not self._entries:
            return  # the common step: nothing started, so no lock taken
        if not self._drain_lock.acquire(blocking=False):
            return  # another thread is draining, in order, and will publish them
        try:
            self._drain(through=None, wait=False)
        finally:
            self._drain_lock.release()

    def publish_through(self, number: int) -> None:
        """Wait for the copies of entries up to ``number`` and publish them."""
        with self._drain_lock:
            self._drain(through=number, wait=True)

    def _drain(self, *, through: int | None, wait: bool) -> None:
        while True:
            with self._entries_lock:
                if not self._entries:
                    return
                entry = self._entries[0]
            if through is not None and entry.number > through:
                return
            try:
                if wait:
                    entry.rows.wait()
                elif not entry.rows.done():
                    return
                buffer: memoryview | None = entry.rows.buffer()
            except Exception:
                self._on_error("copying a step's hidden states to the host")
                buffer = None
            with self._entries_lock:
                self._entries.popleft()
            if buffer is None:
                self.publish_errors(entry.targets, COPY_FAILED)
                continue
            try:
                self._publish(entry.targets, buffer)
            finally:  # after the records: the host buffer may be reused once released
                try:
                    entry.rows.release()
                except Exception:
                    self._on_error("copying a step's hidden states to the host")

    def publish_errors(self, targets: list[RecordTarget], message: str) -> None:
        """Error records for ``targets``: their requests get ``message`` instead of vectors
        (and their regions of the arena go back)."""
        for target in targets:
            self._give_back(target)
            try:
                self._writer.publish_error(target.key, message)
            except Exception:
                self._on_error("publishing an error record to the ring")

    def _give_back(self, target: RecordTarget) -> None:
        if target.region is not None:
            try:
                self._writer.space.release(target.region)
            except Exception:
                self._on_error("giving back a region of the ring's arena")

    def _publish(self, targets: list[RecordTarget], buffer: memoryview) -> None:
        """Publish ``buffer`` (the copied rows, one after another, as bytes) as ``targets``:
        each record a slice of it, no copy before the ring's."""
        count = sum(target.row_count for target in targets)
        row = 4 * int(self._writer.hidden_size)
        if buffer.nbytes != count * row:
            self._on_error("matching copied rows to their keys")
            self.publish_errors(targets, COPY_FAILED)
            return
        at = 0
        for target in targets:
            size = target.row_count * row
            part = buffer[at : at + size]
            at += size
            try:
                self._writer.publish(
                    target.key,
                    part,
                    position=target.position,
                    num_prompt_tokens=target.num_prompt_tokens,
                    layers=target.layers,
                    pooling=target.pooling,
                    rows=target.rows,
                    region=target.region,
                )
            except Exception:
                self._on_error("publishing a hidden state to the ring")
                self.publish_errors([target], PUBLISH_FAILED)
            finally:
                part.release()
