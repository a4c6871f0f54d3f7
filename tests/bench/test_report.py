"""Tables, targets, the markdown report and the JSON (bench/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report as micro
from vllm_hidden_state_proxy.bench.report import (
    PEAK,
    TARGETS,
    Results,
    Table,
    evaluate,
    markdown_table,
    render_markdown,
    summary_cells,
    write_reports,
)
from vllm_hidden_state_proxy.bench.stats import summarize


def sample() -> Results:
    results = Results(meta={"date": "2026-01-01", "machine": "2 cores", "options": {"smoke": 1}})
    results.tables["latency"] = Table(
        "Latency",
        [
            {"arm": "direct", "p50 / direct": 1.0},
            {"arm": "passthrough", "p50 / direct": 1.05},
            {"arm": "flagged_float", "p50 / direct": 1.15, "p50 / passthrough": 1.01},
        ],
    )
    results.tables["throughput"] = Table(
        "Throughput", [{"concurrency": 16, "flagged / direct": 0.9}]
    )
    results.tables["streaming"] = Table(
        "Streaming",
        [
            {"arm": "stream_direct", "burst streams": 9, "n": 10},
            {"arm": "stream_proxy", "burst streams": 1, "n": 10, "ITL mean / direct": 1.0},
        ],
    )
    results.tables["memory"] = Table("Memory", [{"process": PEAK, "RSS MiB": 52.0}])
    results.tables["embeddings"] = Table("Embeddings", note="skipped: --no-embeddings")
    return results


def test_each_target_reads_its_cell_and_a_missing_one_is_not_a_pass() -> None:
    results = sample()
    evaluate(results, (*TARGETS, *micro.TARGETS))  # the developer checks' are not in the sample
    verdicts = {v.target.label: v for v in results.verdicts}
    assert len(TARGETS) == 6 and len(verdicts) == 12
    assert verdicts["flagged / direct, latency p50"].passed is False  # 1.15 > 1.1
    assert verdicts["passthrough / direct, latency p50"].passed is True
    assert verdicts["flagged / passthrough, p50"].passed is True
    assert verdicts["flagged / direct, req/s at 16 in flight"].passed is False
    assert verdicts["proxy peak RSS under load"].value == 52.0
    ring = verdicts["ring publish + lookup p50, 4096-d"]
    assert ring.value is None and ring.passed is None  # not measured
    layers = verdicts["--hidden-state-layers: req/s with / without"]
    assert layers.value is None and layers.passed is None
    rise = verdicts["ordinary p99 rise beside 64 MiB matrices"]
    assert rise.value is None and rise.passed is None  # the matrix arm is not in the sample
    # Most direct streams came in one burst: the inter-token ratio says so.
    assert "9 of 10 stream_direct streams" in verdicts["proxy / direct, inter-token mean"].note


def test_markdown_has_the_targets_and_every_table_in_order() -> None:
    results = sample()
    evaluate(results, (*TARGETS, *micro.TARGETS))
    text = render_markdown(results)
    assert text.startswith("# hidden-state-proxy bench\n\n- date: 2026-01-01\n- machine: 2 cores")
    assert "| flagged / direct, latency p50 | 1.150 | <= 1.1 | **miss** |" in text
    assert "| ring publish + lookup p50, 4096-d | n/a | <= 50 µs | n/a |" in text
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == [
        "## Targets",
        "## Latency",
        "## Streaming",
        "## Throughput",
        "## Embeddings",
        "## Memory",
    ]
    assert "## Embeddings\n\nskipped: --no-embeddings" in text


def test_a_table_has_every_column_any_row_has_and_escapes_pipes() -> None:
    lines = markdown_table([{"a": 1, "b": 0.123456}, {"a": "x|y", "c": 12345.6}])
    assert lines == [
        "| a | b | c |",
        "| --- | --- | --- |",
        "| 1 | 0.1235 |  |",
        "| x\\|y |  | 12346 |",
    ]


def test_a_summary_becomes_cells_named_with_their_unit() -> None:
    cells = summary_cells(summarize([1.0, 2.0, 3.0]))
    assert cells == {"p50 ms": 2.0, "p90 ms": 2.8, "p99 ms": 2.98, "mean ms": 2.0, "n": 3}


def test_json_holds_the_tables_and_the_verdicts(tmp_path: Path) -> None:
    results = sample()
    evaluate(results)
    json_path, markdown_path = write_reports(results, tmp_path / "out")
    document = json.loads(json_path.read_text())
    assert set(document) == {"meta", "targets", "tables", "figures"}
    assert document["tables"]["latency"]["rows"][2]["p50 / passthrough"] == 1.01
    first = document["targets"][0]
    assert first["label"] == "flagged / direct, latency p50" and first["passed"] is False
    assert first["table"] == "latency" and first["value"] == 1.15
    assert markdown_path.read_text() == render_markdown(results)
