"""The ring microbenchmark (benchmarks/ring_micro.py), with tiny counts."""

from __future__ import annotations

import io

from benchmarks.ring_micro import measure_ring, measure_rings

from vllm_hidden_state_proxy.bench.progress import Progress


def test_every_size_and_every_ring_count_is_measured() -> None:
    tables = dict(measure_ring(20, Progress(io.StringIO())))
    assert [row["hidden size"] for row in tables["ring"].rows] == [1024, 4096, 8192]
    for row in tables["ring"].rows:
        for column in ("publish p50 µs", "lookup p50 µs", "floats -> JSON p50 µs"):
            value = row[column]
            assert isinstance(value, float) and value > 0
    rings = tables["rings"]
    assert [row["rings"] for row in rings.rows] == [
        "1 (full)",
        "8 (full)",
        "1 (12.5% full)",
        "8 (12.5% full)",
    ]
    assert rings.get("1 (full)", "hit p50 / 1 full") == 1.0
    assert (rings.get("8 (full)", "miss p50 / 1 full") or 0) > 0


def test_lookups_find_keys_in_every_ring_and_none_for_missing_keys() -> None:
    hit, miss = measure_rings(8, 16, 3)  # raises if a lookup loses a record or finds a stranger
    assert hit.n == 2 and miss.n == 16  # the hits of the slowest of the 8 rings
    assert hit.p50 > 0 and miss.p50 > 0
