"""The ring microbenchmark (bench/ring_micro.py), with tiny counts."""

from __future__ import annotations

import io

from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.ring_micro import measure_ring, measure_rings


def test_every_size_and_every_ring_count_is_measured() -> None:
    tables = dict(measure_ring(20, Progress(io.StringIO())))
    assert [row["hidden size"] for row in tables["ring"].rows] == [1024, 4096, 8192]
    for row in tables["ring"].rows:
        for column in ("publish p50 µs", "lookup p50 µs", "floats -> JSON p50 µs"):
            value = row[column]
            assert isinstance(value, float) and value > 0
    assert [row["rings"] for row in tables["rings"].rows] == [1, 8]
    assert tables["rings"].get(1, "hit p50 / 1 ring") == 1.0
    assert (tables["rings"].get(8, "miss p50 / 1 ring") or 0) > 0


def test_lookups_find_keys_in_every_ring_and_none_for_missing_keys() -> None:
    hit, miss = measure_rings(8, 16)  # raises if a lookup loses a record or finds a stranger
    assert hit.n == 2 and miss.n == 16  # the hits of the slowest of the 8 rings
    assert hit.p50 > 0 and miss.p50 > 0
