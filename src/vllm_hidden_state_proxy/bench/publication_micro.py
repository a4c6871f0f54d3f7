"""The worker's publication path for one matrix, in ms: from the host copy of its rows to its
record in a ring in shared memory (issue #36, item 6).

``python -m vllm_hidden_state_proxy.bench.publication_micro [MiB] [repeats]`` (default 64 MiB,
4096-wide rows, 5 repeats; the median is printed). Two paths, on the same CPU tensor:

- ``per row`` (the hook before #36): every row made ``bytes``, the rows joined, then
  ``RingWriter.publish`` (crc and copy into the ring) of the joined bytes;
- ``contiguous`` (now): ``SyncRowCopier.start(matrix).buffer()``, one view of the host copy,
  then ``RingWriter.publish`` of it, with its region reserved as the hook does.

Each for a float32 matrix (the host copy is the tensor itself) and a bfloat16 one (a model's
dtype: the conversion to float32 is one copy, on both paths).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_hidden_state_proxy.protocol import new_request_key
from vllm_hidden_state_proxy.ring import RingWriter
from vllm_hidden_state_proxy.ring.layout import ARENA_PAYLOAD_OFFSET
from vllm_hidden_state_proxy.worker_hook.device_copy import SyncRowCopier, stack_as_float32

HIDDEN = 4096


def _ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _per_row(matrix: Any) -> bytes:
    array = stack_as_float32(matrix).contiguous().numpy().astype("<f4", copy=False)
    return b"".join([array[i].tobytes() for i in range(array.shape[0])])


def _paths(writer: RingWriter, matrix: Any, repeats: int) -> list[tuple[str, float]]:
    """Both paths for one matrix: (what, ms) each."""
    rows = int(matrix.shape[0])

    def publish(payload: Any, region: int | None = None) -> None:
        writer.publish(
            new_request_key(),
            payload,
            position=0,
            num_prompt_tokens=rows,
            pooling="all_prompt",
            rows=rows,
            region=region,
        )

    copier = SyncRowCopier()
    joined = _per_row(matrix)
    buffer = copier.start(matrix).buffer()

    def contiguous() -> None:
        region = writer.space.reserve(rows * HIDDEN * 4)
        publish(copier.start(matrix).buffer(), region)

    return [
        ("per row: rows to bytes, join", _ms(lambda: _per_row(matrix), repeats)),
        ("per row: publish (crc, copy)", _ms(lambda: publish(joined), repeats)),
        ("per row: total", _ms(lambda: publish(_per_row(matrix)), repeats)),
        ("contiguous: host buffer", _ms(lambda: copier.start(matrix).buffer(), repeats)),
        (
            "contiguous: publish (crc, copy)",
            _ms(lambda: publish(buffer, writer.space.reserve(buffer.nbytes)), repeats),
        ),
        ("contiguous: total", _ms(contiguous, repeats)),
    ]


def measure(mib: int = 64, repeats: int = 5) -> list[tuple[str, str, float]]:
    """(dtype, what, median ms) of both paths for a float32 and a bfloat16 matrix."""
    import torch

    rows = (mib << 20) // (4 * HIDDEN)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="hsp-bench-publication-", dir=base))
    results: list[tuple[str, str, float]] = []
    try:
        with RingWriter.create(
            directory,
            hidden_size=HIDDEN,
            model="bench/model",
            slot_count=64,
            arena_size=2 * ((mib << 20) + ARENA_PAYLOAD_OFFSET),
        ) as writer:
            for dtype in (torch.float32, torch.bfloat16):
                matrix = torch.randn(rows, HIDDEN).to(dtype)
                name = str(dtype).removeprefix("torch.")
                results.extend((name, what, ms) for what, ms in _paths(writer, matrix, repeats))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return results


def main(argv: list[str]) -> None:
    mib = int(argv[0]) if argv else 64
    repeats = int(argv[1]) if len(argv) > 1 else 5
    print(f"publication of one {mib} MiB matrix ({HIDDEN}-wide rows), median of {repeats}, ms")
    for dtype, what, ms in measure(mib, repeats):
        print(f"{dtype:9} {what:34} {ms:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
