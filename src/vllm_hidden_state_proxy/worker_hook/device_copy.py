"""Copy selected rows of a step's hidden states to the host as little-endian float32.

Two copiers share one interface, ``start(rows) -> PendingRows``, where ``rows`` are 1-D
device tensors of one length (views into a step's hidden states, or mean-pooled vectors), or
one 2-D tensor of such rows (a matrix):

- :class:`SyncRowCopier` (CPU tensors): the copy is done when ``start`` returns. On CPU there
  is no device work to overlap, so this stays synchronous and simple.
- :class:`AsyncRowCopier` (CUDA and any other non-CPU device): enqueues, on the device's current
  stream, one ``stack`` with the float32 conversion, one non-blocking copy into a pinned host
  buffer, and an event. ``start`` returns at once; the caller asks ``done()``
  (``event.query()``, never blocks) or ``wait()`` (``event.synchronize()``) before reading
  ``buffer()``. Taking a row as ``hidden_states[i]`` (a Python int) makes a view and launches
  nothing, so no index has to be uploaded.

Pinned buffers come from a small :class:`PinnedBufferPool`. A buffer returns to the pool only
through ``release()``, which callers invoke after ``done()``/``wait()`` reported the copy
complete, so a buffer still being written by the device is never handed out again; a copy that
failed never returns its buffer at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class PendingRows(Protocol):
    """One started copy of a step's selected rows."""

    def done(self) -> bool:
        """Whether the copy has completed; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy has completed."""
        ...

    def buffer(self) -> memoryview:
        """The rows, in the order given to ``start``, as one contiguous run of little-endian
        float32 bytes (a view of the host copy: no copy is made).

        Only valid once ``done()`` returned True or ``wait()`` returned, and until
        ``release()``.
        """
        ...

    def release(self) -> None:
        """Give host buffers back for reuse; call once, after ``buffer()`` is no longer used."""
        ...


class RowCopier(Protocol):
    def start(self, rows: Sequence[Any]) -> PendingRows: ...


def stack_as_float32(rows: Sequence[Any]) -> Any:
    """One ``[len(rows), hidden_size]`` float32 tensor on the rows' device."""
    import torch

    if isinstance(rows, torch.Tensor):  # already one 2-D tensor of rows
        return rows.to(torch.float32)
    dtypes = {row.dtype for row in rows}
    if len(dtypes) == 1:
        return torch.stack(list(rows)).to(torch.float32)
    return torch.stack([row.to(torch.float32) for row in rows])


def host_float32(rows: Sequence[Any]) -> Any:
    """Synchronous: the rows as one C-contiguous little-endian float32 numpy array
    ``[len(rows), hidden_size]`` (a float32 CPU matrix is not copied)."""
    stacked = stack_as_float32(rows).to(device="cpu")
    return _little_endian(stacked.contiguous().numpy())


def _little_endian(array: Any) -> Any:
    """``array`` as C-contiguous little-endian float32 (no copy on a little-endian host)."""
    import numpy as np

    return np.ascontiguousarray(array.astype("<f4", copy=False))


def as_bytes(array: Any) -> memoryview:
    """A C-contiguous array's bytes, without a copy."""
    return memoryview(array).cast("B")


# -- CPU: synchronous -----------------------------------------------------------------------------


class ReadyRows:
    """A copy that completed before ``start`` returned: ``array``, C-contiguous LE float32."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def buffer(self) -> memoryview:
        return as_bytes(self._array)

    def release(self) -> None:
        return None


class SyncRowCopier:
    def start(self, rows: Sequence[Any]) -> PendingRows:
        return ReadyRows(host_float32(rows))


# -- devices: asynchronous ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class HostBuffers:
    """Host memory for up to ``capacity`` float32 rows.

    Compared by identity (``eq=False``): the pool finds a buffer in its free list with
    ``list.remove``, and a value comparison would compare the tensors, which raises for two of
    different sizes (and is ambiguous for two of the same).
    """

    rows: Any  # float32 tensor [capacity, hidden_size]

    @property
    def capacity(self) -> int:
        return int(self.rows.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.rows.shape[1])


def allocate_pinned(capacity: int, hidden_size: int) -> HostBuffers:
    import torch

    return HostBuffers(
        rows=torch.empty((capacity, hidden_size), dtype=torch.float32, pin_memory=True),
    )


class PinnedBufferPool:
    """Reuses host buffers between steps; sizes are powers of two (at least ``min_rows``).

    Thread-safe: buffers are taken on the worker's main thread and may be released on the
    thread that forwards vLLM's output.
    """

    def __init__(
        self,
        allocate: Callable[[int, int], HostBuffers] = allocate_pinned,
        *,
        max_free: int = 4,
        min_rows: int = 8,
    ) -> None:
        self._allocate = allocate
        self._max_free = max_free
        self._min_rows = min_rows
        self._free: list[HostBuffers] = []
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self, rows: int, hidden_size: int) -> HostBuffers:
        """A free buffer holding at least ``rows`` rows (the smallest such), or a new one."""
        with self._lock:
            fitting = [b for b in self._free if b.capacity >= rows and b.hidden_size == hidden_size]
            if fitting:
                best = min(fitting, key=lambda b: b.capacity)
                self._free.remove(best)
                return best
        capacity = max(self._min_rows, 1 << max(rows - 1, 0).bit_length())
        return self._allocate(capacity, hidden_size)

    def release(self, buffers: HostBuffers) -> None:
        """Return buffers whose copy has completed. Beyond ``max_free``, the smallest go."""
        with self._lock:
            self._free.append(buffers)
            if len(self._free) > self._max_free:
                self._free.remove(min(self._free, key=lambda b: b.capacity))


class InFlightRows:
    """A device-to-host copy that completes when its event does."""

    def __init__(
        self,
        event: Any,
        buffers: HostBuffers,
        count: int,
        pool: PinnedBufferPool,
        device_tensors: tuple[Any, ...],
    ) -> None:
        self._event = event
        self._buffers: HostBuffers | None = buffers
        self._count = count
        self._pool = pool
        # The device tensors the copy reads stay referenced until it is known to be complete.
        self._device_tensors: tuple[Any, ...] = device_tensors
        self._completed = False

    def done(self) -> bool:
        if not self._completed and self._event.query():
            self._completed = True
        return self._completed

    def wait(self) -> None:
        if not self._completed:
            self._event.synchronize()
            self._completed = True

    def _host(self) -> Any:
        if not self._completed or self._buffers is None:
            raise RuntimeError("the host copy has not completed (or was released)")
        return _little_endian(self._buffers.rows[: self._count].numpy())

    def buffer(self) -> memoryview:
        return as_bytes(self._host())

    def release(self) -> None:
        buffers, self._buffers = self._buffers, None
        self._device_tensors = ()
        if buffers is not None and self._completed:
            self._pool.release(buffers)


def new_event(device: Any) -> Any:
    """An event to record on the device's current stream (a sleeping one on CUDA)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.Event(blocking=True)  # synchronize() sleeps instead of spinning
    return torch.Event(device=device)


def record_on_current_stream(event: Any, device: Any) -> None:
    import torch

    if device.type == "cuda":
        event.record(torch.cuda.current_stream(device))
    else:
        event.record()


class AsyncRowCopier:
    """Enqueues the gather and the copy on the device's current stream; never waits for them."""

    def __init__(
        self,
        pool: PinnedBufferPool | None = None,
        make_event: Callable[[Any], Any] = new_event,
        record: Callable[[Any, Any], None] = record_on_current_stream,
    ) -> None:
        self.pool = pool if pool is not None else PinnedBufferPool()
        self._make_event = make_event
        self._record = record

    def start(self, rows: Sequence[Any]) -> PendingRows:
        device = rows[0].device
        count = len(rows)
        # A pooled buffer's previous copies have completed: it is free to be written again.
        buffers = self.pool.take(count, int(rows[0].shape[0]))
        stacked = stack_as_float32(rows)
        buffers.rows[:count].copy_(stacked, non_blocking=True)
        event = self._make_event(device)
        self._record(event, device)
        return InFlightRows(event, buffers, count, self.pool, (stacked,))


def copier_for(device: Any) -> RowCopier:
    return SyncRowCopier() if device.type == "cpu" else AsyncRowCopier()
