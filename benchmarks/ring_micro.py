"""Ring microbenchmark, in µs per call, on rings in shared memory like the real ones.

- ``RingWriter.publish`` and ``RingDirectory.lookup`` for several hidden sizes, plus what the
  proxy does with a found record (its float32 view, that as JSON, the bytes as base64), done
  here as the proxy does it: numpy's view of the bytes, written by orjson.
- ``RingDirectory.lookup`` with 1 and with 8 live rings in one directory (one per vLLM engine,
  issue #12), full and 1/8 full: a key in the ring searched last, and a key in no ring.

Every use of the ring's API is in the four functions at the top, to adapt in one place.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import Summary, ratio, summarize
from vllm_hidden_state_proxy.protocol import new_request_key
from vllm_hidden_state_proxy.ring import Record, RingDirectory, RingWriter
from vllm_hidden_state_proxy.worker_hook.settings import RING_SLOTS

HIDDEN_SIZES = (1024, 4096, 8192)
#: (live rings in the directory, the share of their slots that hold a record).
RING_SETUPS = ((1, 1.0), (8, 1.0), (1, 0.125), (8, 0.125))
MODEL_NAME = "bench/model"


def _writer(directory: Path, number: int, hidden_size: int) -> RingWriter:
    return RingWriter.create(
        directory,
        engine=number,
        hidden_size=hidden_size,
        model=MODEL_NAME,
        slot_count=RING_SLOTS.default,
    )


def _publish(writer: RingWriter, key: bytes, vector: bytes, number: int) -> None:
    writer.publish(key, vector, position=number, num_prompt_tokens=number + 1)


def _floats(record: Record) -> npt.NDArray[np.float32]:
    """The "float" format's vector: the record's little-endian float32 bytes, viewed."""
    vector = record.vector(record.layers[0])
    return np.frombuffer(vector, dtype="<f4").astype(np.float32, copy=False)


def _check(record: object, vector: bytes) -> Record:
    if not isinstance(record, Record) or record.vector(record.layers[0]) != vector:
        raise RuntimeError("a ring lookup lost the record it was just given")
    return record


def _random_vector(hidden_size: int, seed: int) -> bytes:
    """Normal float32 values, as a hidden state has (JSON of zeros would be short)."""
    generator = random.Random(seed)
    return struct.pack(f"<{hidden_size}f", *(generator.gauss(0, 1) for _ in range(hidden_size)))


@contextlib.contextmanager
def _rings(count: int, hidden_size: int) -> Iterator[tuple[list[RingWriter], RingDirectory]]:
    """``count`` live rings in a fresh directory in shared memory, and the proxy's view of it."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="hsp-bench-ring-", dir=base))
    writers: list[RingWriter] = []
    try:
        writers = [_writer(directory, number, hidden_size) for number in range(count)]
        with RingDirectory(directory) as rings:
            yield writers, rings
    finally:
        for writer in writers:
            writer.close()
        shutil.rmtree(directory, ignore_errors=True)


def measure_size(hidden_size: int, operations: int) -> Row:
    vectors = [_random_vector(hidden_size, seed) for seed in range(8)]
    steps = ("publish", "lookup", "floats", "json", "base64")
    times: dict[str, list[float]] = {step: [] for step in steps}
    clock = time.perf_counter_ns
    with _rings(1, hidden_size) as ([writer], rings):
        # One lap of the ring first, not timed: a server's ring is mapped and its pages touched
        # after its first lap; a fresh file's page faults are a one-off (and a noisy one).
        for number in range(RING_SLOTS.default):
            key = new_request_key()
            _publish(writer, key, vectors[0], number)
            _check(rings.lookup(key), vectors[0])
        for number in range(operations):
            key, vector = new_request_key(), vectors[number % len(vectors)]
            t0 = clock()
            _publish(writer, key, vector, number)
            t1 = clock()
            found = rings.lookup(key)
            t2 = clock()
            record = _check(found, vector)
            t3 = clock()
            floats = _floats(record)
            t4 = clock()
            orjson.dumps(floats, option=orjson.OPT_SERIALIZE_NUMPY)  # as the proxy writes it
            t5 = clock()
            base64.b64encode(vector)  # the record's, as _check found
            t6 = clock()
            for step, ns in zip(steps, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5), strict=True):
                times[step].append(ns / 1e3)
    s = {name: summarize(values) for name, values in times.items()}
    return {
        "hidden size": hidden_size,
        "publish p50 µs": s["publish"].p50,
        "publish p99 µs": s["publish"].p99,
        "lookup p50 µs": s["lookup"].p50,
        "lookup p99 µs": s["lookup"].p99,
        "publish + lookup p50 µs": s["publish"].p50 + s["lookup"].p50,
        "floats p50 µs": s["floats"].p50,
        "floats -> JSON p50 µs": s["json"].p50,
        "bytes -> base64 p50 µs": s["base64"].p50,
    }


def measure_rings(
    count: int, operations: int, records: int, hidden_size: int = 128
) -> tuple[Summary, Summary]:
    """µs per lookup in a directory of ``count`` live rings holding ``records`` records each:
    (of keys in the ring searched last, of keys in no ring)."""
    vector = _random_vector(hidden_size, 0)
    with _rings(count, hidden_size) as (writers, rings):
        keys = [[new_request_key() for _ in range(records)] for _ in writers]
        for writer, ring_keys in zip(writers, keys, strict=True):
            for number, key in enumerate(ring_keys):
                _publish(writer, key, vector, number)
        hits: list[list[float]] = [[] for _ in writers]
        misses: list[float] = []
        clock = time.perf_counter_ns
        for number in range(operations):
            ring, missing = number % count, new_request_key()
            key = keys[ring][number // count % records]
            t0 = clock()
            found = rings.lookup(key)
            t1 = clock()
            not_found = rings.lookup(missing)
            t2 = clock()
            _check(found, vector)
            if not_found is not None:
                raise RuntimeError("a ring lookup found a key nobody published")
            hits[ring].append((t1 - t0) / 1e3)
            misses.append((t2 - t1) / 1e3)
    # The directory's search order is its own: the ring searched last is the slowest to hit.
    return max((summarize(times) for times in hits), key=lambda s: s.p50), summarize(misses)


def measure_ring(operations: int, progress: Progress) -> list[tuple[str, Table]]:
    task = progress.task("ring microbenchmark", len(HIDDEN_SIZES) + len(RING_SETUPS))
    slots = RING_SLOTS.default
    sizes: list[Row] = []
    for hidden_size in HIDDEN_SIZES:
        sizes.append(measure_size(hidden_size, operations))
        task.advance()
    lookups = []
    for count, fill in RING_SETUPS:
        lookups.append((count, fill, *measure_rings(count, operations, int(slots * fill))))
        task.advance()
    one_hit, one_miss = lookups[0][2:]
    setups: list[Row] = [
        {
            "rings": f"{count} ({'full' if fill == 1 else f'{fill:.1%} full'})",
            "hit p50 µs": hit.p50,
            "hit p99 µs": hit.p99,
            "miss p50 µs": miss.p50,
            "miss p99 µs": miss.p99,
            "hit p50 / 1 full": ratio(hit.p50, one_hit.p50),
            "miss p50 / 1 full": ratio(miss.p50, one_miss.p50),
        }
        for count, fill, hit, miss in lookups
    ]
    task.done()
    note = (
        f"Rings of {slots} slots, records of hidden size 128. Hit: a key in the "
        "ring searched last (the ring whose keys took longest to find); miss: a key in no ring "
        "(every ring searched). A ring that is not full yet (a fresh engine) is measured too."
    )
    return [
        ("ring", Table("Ring microbenchmark (µs per call)", sizes)),
        ("rings", Table("Ring lookup with 1 and 8 live rings (µs per call)", setups, note)),
    ]
