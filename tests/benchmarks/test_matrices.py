"""The matrix size sweep (benchmarks/matrices.py): a real instant upstream and proxy per size, small
sizes. No timing thresholds: the numbers must only be there, and grow with the size."""

from __future__ import annotations

import io
from pathlib import Path

from benchmarks import matrices
from vllm_hidden_state_proxy.bench.progress import Progress


def test_pulls_span_enough_bytes_and_cpu_ticks() -> None:
    assert [matrices.sweep_pulls(mib) for mib in (1, 4, 16, 64, 1024)] == [64, 64, 32, 8, 4]
    assert matrices.sweep_pulls(1, matrices.MIN_PULLS) == 4  # --smoke's


def test_each_size_gets_its_row(tmp_path: Path) -> None:
    table = matrices.run_size_sweep(tmp_path, (1, 2), Progress(io.StringIO()), most_pulls=8)
    assert [row["matrix MiB"] for row in table.rows] == [1, 2]
    for row in table.rows:
        assert row["pulls"] == 8
        for column in ("pull p50 ms", "MB/s of rows"):
            value = row[column]
            assert isinstance(value, float) and value > 0, (column, row)
        # The process clock ticks every 10 ms: a few small pulls can cost less than a tick.
        assert isinstance(row["proxy CPU ms/matrix"], float) and row["proxy CPU ms/matrix"] >= 0
    assert (tmp_path / "instant-proxy-0.log").exists()  # the servers' logs go there
