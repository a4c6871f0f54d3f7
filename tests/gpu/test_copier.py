"""The row copiers on the device: what they copy, and their host buffers under load.

- :func:`test_the_copy_is_the_cpu_paths` -- vectors, matrices and rows of mixed dtypes, from
  float32, bfloat16 and float16 (zeros of both signs, subnormals, the extremes, infinities, NaN),
  copied by the device's copier (``copier_for``: ``AsyncRowCopier`` on CUDA, into pinned buffers,
  behind a busy stream) equal the CPU path's bytes (``SyncRowCopier``), value for value;
- :func:`test_no_buffer_is_handed_out_while_its_copy_is_in_flight` -- a few hundred overlapping
  steps: each overwrites a static buffer, starts copies of some of its rows (and now and then a
  matrix) through one pool of host buffers, and publishes them through the hook's publication
  queue to a real ring, lagging a random number of steps behind; every record's checksum is
  its step's. On CPU the copier runs with events that complete only after a few polls (the pool's
  discipline); on CUDA with real events and pinned buffers, the device kept behind the host.
  ``compute-sanitizer --tool racecheck`` runs this one (``tests/gpu/run.py``), with
  ``HSP_GPU_STRESS_STEPS`` steps.
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.devices import DEVICES, device_of, sleep_on_stream
from tests.gpu.model import FINAL
from tests.gpu.scenario import ring
from vllm_hidden_state_proxy.ring.records import matrix_bytes
from vllm_hidden_state_proxy.worker_hook.device_copy import (
    AsyncRowCopier,
    HostBuffers,
    PinnedBufferPool,
    SyncRowCopier,
    allocate_pinned,
    copier_for,
)
from vllm_hidden_state_proxy.worker_hook.publication_queue import PublicationQueue, RecordTarget

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Steps of the stress run (fewer under compute-sanitizer, which is slow).
STRESS_STEPS = int(os.environ.get("HSP_GPU_STRESS_STEPS", "300"))
#: Set by ``run.py`` under compute-sanitizer, which serializes the device's work with the host's:
#: the copies are then rarely still in flight, and only what they hold is checked.
UNDER_SANITIZER = os.environ.get("HSP_GPU_SANITIZER") == "1"


def special_values(dtype: Any, hidden: int) -> torch.Tensor:
    """``[8, hidden]`` float32 values, each exact in ``dtype``: zeros of both signs, the
    smallest normal, a subnormal, the largest finite, infinities, NaN, then ordinary ones."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal
    specials = [0.0, -0.0, tiny, -tiny, tiny / 4, info.max, -info.max]
    specials += [float("inf"), float("-inf"), float("nan")]
    rng = np.random.default_rng(49)
    values = rng.standard_normal((8, hidden)) * 100
    values[0, : len(specials)] = specials
    return torch.from_numpy(values).to(torch.float32).to(dtype).to(torch.float32)


def as_float32(pending: Any, hidden: int) -> np.ndarray[Any, Any]:
    pending.wait()
    assert pending.done()
    values: np.ndarray[Any, Any] = np.frombuffer(pending.buffer(), "<f4").reshape(-1, hidden).copy()
    pending.release()
    return values


def same_bits(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    """Every value's bits equal (``-0.0`` is not ``0.0``); NaN where NaN (its payload may be
    the device's own)."""
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", ["vectors", "matrix", "mixed"])
def test_the_copy_is_the_cpu_paths(device_name: str, dtype: Any, shape: str) -> None:
    device = device_of(device_name)
    hidden = 4096 if device.type == "cuda" else 256
    exact = special_values(dtype, hidden)  # float32 on the host
    states = exact.to(dtype).to(device)  # a step's hidden states, as the model holds them
    other = exact.flip(0).to(torch.float32).to(device)  # e.g. a mean-pooled vector
    if shape == "vectors":
        picked = [5, 0, 7, 0, 3]
        rows: Any = [states[i] for i in picked]
        want = exact[picked]
    elif shape == "matrix":
        rows = states[:6]
        want = exact[:6]
    else:
        rows = [states[2], other[0], states[0]]
        want = torch.stack([exact[2], exact.flip(0)[0], exact[0]])
    copier = copier_for(device)
    # The stream is busy, as behind a forward: on CUDA, start returns before the copy is done.
    sleep_on_stream(device, 20_000)
    pending = copier.start(rows)
    if device.type == "cuda":
        assert isinstance(copier, AsyncRowCopier)
        assert not pending.done()
        assert pending._buffers.rows.is_pinned()  # type: ignore[attr-defined]
    got = as_float32(pending, hidden)
    same_bits(got, want.numpy())
    # ... and the CPU path's bytes, from the same rows on the host.
    on_host = [row.cpu() for row in rows] if isinstance(rows, list) else rows.cpu()
    same_bits(got, as_float32(SyncRowCopier().start(on_host), hidden))


# -- the stress run --------------------------------------------------------------------------------


class WatchedPool(PinnedBufferPool):
    """The copier's pool, refusing to hand out a buffer whose copy is in flight."""

    def __init__(self, allocate: Callable[[int, int], HostBuffers]) -> None:
        super().__init__(allocate, max_free=4)
        self.in_flight: set[int] = set()  # ids of live buffers: no other object has theirs
        self.most_in_flight = 0
        self.reused = 0

    def take(self, rows: int, hidden_size: int) -> HostBuffers:
        free = self.free_count
        buffers = super().take(rows, hidden_size)
        assert id(buffers) not in self.in_flight, "a buffer was handed out while in flight"
        self.reused += self.free_count < free
        self.in_flight.add(id(buffers))
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return buffers

    def release(self, buffers: HostBuffers) -> None:
        assert id(buffers) in self.in_flight, "a buffer was released twice"
        self.in_flight.discard(id(buffers))
        super().release(buffers)


class SlowEvent:
    """On CPU: an event that reports its copy complete only after a few polls."""

    def __init__(self, polls: int) -> None:
        self._polls = polls

    def query(self) -> bool:
        self._polls -= 1
        return self._polls < 0

    def synchronize(self) -> None:
        self._polls = -1


def unpinned(capacity: int, hidden_size: int) -> HostBuffers:
    return HostBuffers(rows=torch.empty((capacity, hidden_size), dtype=torch.float32))


def fill_values(step: int, tokens: int, hidden: int) -> np.ndarray[Any, Any]:
    """Step ``step``'s states before the cast: multiples of 1/64, another pattern each step."""
    base = np.arange(tokens * hidden, dtype=np.int64).reshape(tokens, hidden)
    values: np.ndarray[Any, Any] = ((base + step * 7919) % 4093 - 2046).astype(np.float32) / 64
    return values


def record_key(step: int, index: int) -> bytes:
    return step.to_bytes(8, "big") + (index + 1).to_bytes(8, "big")


@pytest.mark.parametrize("device_name", DEVICES)
def test_no_buffer_is_handed_out_while_its_copy_is_in_flight(
    tmp_path: Path, device_name: str
) -> None:
    device = device_of(device_name)
    cuda = device.type == "cuda"
    tokens, hidden = 128, 1024 if cuda else 256
    rng = random.Random(49)
    pool = WatchedPool(allocate_pinned if cuda else unpinned)
    if cuda:
        copier = AsyncRowCopier(pool)
    else:
        copier = AsyncRowCopier(
            pool, lambda device: SlowEvent(rng.randint(0, 3)), lambda event, device: None
        )
    base = torch.arange(tokens * hidden, dtype=torch.int64, device=device).reshape(tokens, hidden)
    statics = {dtype: torch.zeros((tokens, hidden), dtype=dtype, device=device) for dtype in DTYPES}
    expected: dict[bytes, int] = {}  # key -> CRC-32 of the record's float32 bytes
    errors: list[str] = []
    verified = started_unfinished = 0
    with ring(tmp_path, hidden, layers=(FINAL,), slots=4096, arena_mib=64) as shared:
        queue = PublicationQueue(shared.writer, errors.append)

        def verify() -> None:
            nonlocal verified
            for k in list(expected):
                found = shared.reader.lookup(k)
                if found is None:
                    continue  # not published yet
                data = bytes(getattr(found, "vectors", b""))
                assert zlib.crc32(data) == expected.pop(k), f"record {k.hex()} is not its step's"
                verified += 1

        for step in range(STRESS_STEPS):
            dtype = DTYPES[step % len(DTYPES)]
            static = statics[dtype]
            # More device time a step than the host spends on it: the copies pile up.
            sleep_on_stream(device, rng.choice([2000, 3000, 4000]))
            # The step overwrites its buffer on the stream, as a forward does.
            static.copy_(((base + step * 7919) % 4093 - 2046).to(torch.float32) / 64)
            held = torch.from_numpy(fill_values(step, tokens, hidden)).to(dtype).float().numpy()
            picked = [rng.randrange(tokens) for _ in range(rng.randint(1, 48))]
            targets = []
            for index, row in enumerate(picked):
                expected[record_key(step, index)] = zlib.crc32(held[row].tobytes())
                targets.append(RecordTarget(record_key(step, index), row, row + 1, (FINAL,)))
            copies = [(copier.start([static[row] for row in picked]), targets)]
            if rng.random() < 0.25:  # a matrix, into its region of the arena
                first = rng.randrange(tokens)
                end = rng.randint(first + 1, tokens)
                region = shared.writer.space.reserve(matrix_bytes(end - first, 1, hidden))
                matrix_key = record_key(step, 999)
                expected[matrix_key] = zlib.crc32(held[first:end].tobytes())
                target = RecordTarget(
                    matrix_key, first, end, (FINAL,), "all_prompt", end - first, region
                )
                copies.append((copier.start(static[first:end]), [target]))
            for pending, to in copies:
                queue.add(pending, to)  # publishes at once what is already complete
                started_unfinished += len(queue) > 0
            # The output thread, 0 to 6 steps behind: the copies in flight grow to 7 steps'
            # (and more with the matrices), then all are waited for.
            lag = step % 7
            if queue.last_number > lag:
                queue.publish_through(queue.last_number - lag)
            verify()
        queue.publish_through(queue.last_number)
        verify()
    assert not errors
    assert not expected, f"{len(expected)} records never published"
    assert verified > STRESS_STEPS
    assert pool.in_flight == set()
    assert pool.reused > 0
    if not UNDER_SANITIZER:
        # The run was a stress: several copies were in flight at once, some unfinished when
        # the next was started.
        assert pool.most_in_flight > 4
        assert started_unfinished > 0
