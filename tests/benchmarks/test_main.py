"""The developer checks' runner (benchmarks/__main__.py): the checks that need no vLLM, in smoke
mode, with their report beside the bench's. No timing thresholds: the numbers must be there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks.__main__ import main


def rows(report: dict[str, Any], table: str) -> dict[Any, dict[str, Any]]:
    return {next(iter(row.values())): row for row in report["tables"][table]["rows"]}


def positive(row: dict[str, Any], *columns: str) -> None:
    for column in columns:
        assert isinstance(row[column], (int, float)) and row[column] > 0, (column, row)


def clock_read(row: dict[str, Any], *columns: str) -> None:
    """CPU columns: read from the kernel's per-process clock, which ticks every 10 ms, so a
    smoke run's four 1 MiB pulls can cost the proxy less than one tick (a fresh clone's run
    read 0.0): present and not negative."""
    for column in columns:
        assert isinstance(row[column], (int, float)) and row[column] >= 0, (column, row)


def test_the_ring_and_the_matrix_checks_write_their_report(tmp_path: Path) -> None:
    assert main(["--smoke", "--checks", "ring,matrices", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "micro.json").read_text())
    assert not (tmp_path / "bench.json").exists()  # the bench's report is not overwritten
    assert [row["hidden size"] for row in report["tables"]["ring"]["rows"]] == [1024, 4096, 8192]
    assert len(rows(report, "rings")) == 4  # 1 and 8 rings, full and not
    positive(rows(report, "rings")["8 (full)"], "hit p50 µs", "miss p50 µs")
    matrices = rows(report, "matrices")
    positive(matrices["MB/s of 4 MiB matrices, 1 client"], "value")
    positive(matrices["ordinary p99 ms, beside pulls"], "value")
    positive(matrices["proxy private MiB, peak under lists and silent clients"], "value")
    sizes = report["tables"]["matrix_sizes"]["rows"]
    assert [row["matrix MiB"] for row in sizes] == [1, 4]  # --smoke's
    for row in sizes:
        positive(row, "pull p50 ms", "MB/s of rows")
        clock_read(row, "proxy CPU ms/matrix")
    measured = [t for t in report["targets"] if t["table"] in ("ring", "matrices")]
    assert len(measured) == 3 and all(t["value"] is not None for t in measured)
    assert [link["file"] for link in report["figures"]["matrix_sizes"]] == ["bench-matrix-cost.png"]
    assert (tmp_path / "micro.md").read_text().startswith("# hidden-state-proxy developer checks")


def test_an_unknown_check_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--checks", "ring,nope", "--output-dir", str(tmp_path)]) == 2
    assert "unknown checks nope" in capsys.readouterr().err
