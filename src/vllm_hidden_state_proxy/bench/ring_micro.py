"""Ring microbenchmark: ``RingWriter.publish`` and ``RingDirectory.lookup`` in µs per call,
for several hidden sizes, on a ring in shared memory like the real one; plus what the proxy
does with a found record (``as_floats``, the floats as JSON, the bytes as base64)."""

from __future__ import annotations

import base64
import os
import random
import shutil
import sys
import tempfile
import time
from array import array
from pathlib import Path

import orjson

from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import RingPoint
from vllm_hidden_state_proxy.bench.stats import summarize
from vllm_hidden_state_proxy.protocol import DEFAULT_RING_SLOTS, new_request_key
from vllm_hidden_state_proxy.ring import Record, RingDirectory, RingWriter

HIDDEN_SIZES = (1024, 4096, 8192)
MODEL_NAME = "bench/model"


def _random_vector(hidden_size: int, seed: int) -> bytes:
    """Normal-distributed float32 values (as a real hidden state: JSON of NaN would be short)."""
    generator = random.Random(seed)
    values = array("f", (generator.gauss(0.0, 1.0) for _ in range(hidden_size)))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def _shm_dir() -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="hsp-bench-ring-", dir=base))


def measure_size(hidden_size: int, operations: int) -> RingPoint:
    directory = _shm_dir()
    try:
        writer = RingWriter.create(
            directory,
            hidden_size=hidden_size,
            model=MODEL_NAME,
            slot_count=DEFAULT_RING_SLOTS,
        )
        rings = RingDirectory(directory)
        try:
            vectors = [_random_vector(hidden_size, seed) for seed in range(8)]
            publish: list[float] = []
            lookup: list[float] = []
            as_floats: list[float] = []
            as_json: list[float] = []
            as_base64: list[float] = []
            clock = time.perf_counter_ns
            for number in range(operations):
                key = new_request_key()
                vector = vectors[number % len(vectors)]
                t0 = clock()
                writer.publish(key, vector, position=number, num_prompt_tokens=number + 1)
                t1 = clock()
                record = rings.lookup(key)
                t2 = clock()
                if not isinstance(record, Record) or record.vector(1) != vector:
                    raise RuntimeError(f"ring lookup lost the record it was just given ({key!r})")
                floats = record.floats(1)
                t3 = clock()
                orjson.dumps(floats)
                t4 = clock()
                base64.b64encode(record.vector(1))
                t5 = clock()
                publish.append((t1 - t0) / 1e3)
                lookup.append((t2 - t1) / 1e3)
                as_floats.append((t3 - t2) / 1e3)
                as_json.append((t4 - t3) / 1e3)
                as_base64.append((t5 - t4) / 1e3)
        finally:
            rings.close()
            writer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return RingPoint(
        hidden_size=hidden_size,
        publish_us=summarize(publish),
        lookup_us=summarize(lookup),
        as_floats_us=summarize(as_floats),
        json_us=summarize(as_json),
        base64_us=summarize(as_base64),
    )


def measure_ring(operations: int, progress: Progress) -> list[RingPoint]:
    task = progress.task("ring microbenchmark (publish + lookup)", len(HIDDEN_SIZES))
    points = []
    for hidden_size in HIDDEN_SIZES:
        points.append(measure_size(hidden_size, operations))
        task.advance()
    task.done()
    return points
