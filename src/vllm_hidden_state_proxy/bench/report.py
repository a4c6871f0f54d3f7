"""What a run found: one table per phase (rows of named cells, the same in bench.md and in
bench.json; ratios between arms are columns), the targets, each a limit on one cell, and the
figures drawn from the tables (``figures.py``), each linked after the table it illustrates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from vllm_hidden_state_proxy.bench.stats import Summary

Cell = float | int | str | None
#: One arm (or one arm at one level): column -> value. The first cell names the row.
Row = dict[str, Cell]

#: The order of the report's sections (tables not named here follow in the order measured).
ORDER = ("latency", "streaming", "answers", "throughput", "embeddings", "cpu", "memory")
#: The memory table's row of the proxy's peak RSS during the throughput and embeddings phases.
PEAK = "proxy, peak under load"


def summary_cells(summary: Summary) -> Row:
    """A summary of milliseconds as cells."""
    s = summary
    return {"p50 ms": s.p50, "p90 ms": s.p90, "p99 ms": s.p99, "mean ms": s.mean, "n": s.n}


@dataclass
class Table:
    title: str
    rows: list[Row] = field(default_factory=list)
    #: How to read the table, or why it is empty (a phase left out).
    note: str = ""

    def get(self, key: Cell, column: str) -> float | None:
        """The number in ``column`` of the row named ``key`` (None if either is missing)."""
        for row in self.rows:
            if next(iter(row.values())) == key:
                value = row.get(column)
                return float(value) if isinstance(value, (int, float)) else None
        return None


@dataclass(frozen=True)
class Target:
    """A goal for the number at (``table``, ``row``, ``column``)."""

    label: str
    table: str
    row: Cell
    column: str
    op: Literal["<=", ">="]
    limit: float
    unit: str = ""


TARGETS = (
    Target("flagged / direct, latency p50", "latency", "flagged_float", "p50 / direct", "<=", 1.1),
    Target("passthrough / direct, latency p50",
           "latency", "passthrough", "p50 / direct", "<=", 1.08),
    Target("flagged / passthrough, p50",
           "latency", "flagged_float", "p50 / passthrough", "<=", 1.02),
    Target("flagged / direct, req/s at 16 in flight",
           "throughput", 16, "flagged / direct", ">=", 0.95),
    Target("proxy / direct, inter-token mean",
           "streaming", "stream_proxy", "ITL mean / direct", "<=", 1.02),
    Target("proxy peak RSS under load", "memory", PEAK, "RSS MiB", "<=", 150.0, "MiB"),
)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    target: Target
    value: float | None
    #: Why the value may not mean what the label says.
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        limit = self.target.limit
        return self.value <= limit if self.target.op == "<=" else self.value >= limit


class FigureLink(NamedTuple):
    """A figure written next to the report: its file name there, and what it shows."""

    file: str
    caption: str


@dataclass
class Results:
    meta: dict[str, Any]
    #: The report's heading (not in the JSON).
    title: str = field(default="hidden-state-proxy bench", kw_only=True)
    tables: dict[str, Table] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    #: Table name -> the figures drawn from it (and others), linked after that table.
    figures: dict[str, list[FigureLink]] = field(default_factory=dict)

    def value(self, table: str, key: Cell, column: str) -> float | None:
        found = self.tables.get(table)
        return None if found is None else found.get(key, column)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "targets": [
                {**asdict(v.target), "value": v.value, "passed": v.passed, "note": v.note}
                for v in self.verdicts
            ],
            "tables": {name: asdict(table) for name, table in self.tables.items()},
            "figures": {
                name: [link._asdict() for link in links] for name, links in self.figures.items()
            },
        }


def _burst_note(results: Results) -> str:
    """Most streams of an arm came in one burst: their gaps are ~0, so the inter-token ratio
    compares two near-zero numbers (read time to last token then)."""
    for arm in ("stream_direct", "stream_proxy"):
        bursts, streams = (results.value("streaming", arm, c) for c in ("burst streams", "n"))
        if bursts is not None and streams and 2 * bursts > streams:
            return f"{bursts:.0f} of {streams:.0f} {arm} streams came in one burst"
    return ""


def evaluate(results: Results, targets: Sequence[Target] = TARGETS) -> None:
    """Each target's value and verdict."""
    note = _burst_note(results)
    results.verdicts = [
        Verdict(t, results.value(t.table, t.row, t.column), note if t.table == "streaming" else "")
        for t in targets
    ]


def _text(value: Cell) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[Mapping[str, Cell]]) -> list[str]:
    """A GitHub table whose columns are every column any row has, in the order first seen."""
    columns = list(dict.fromkeys(column for row in rows for column in row))

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [
        line([_text(column) for column in columns]),
        line(["---"] * len(columns)),
        *(line([_text(row.get(column)) for column in columns]) for row in rows),
    ]


def render_markdown(results: Results) -> str:
    lines = [f"# {results.title}", ""]
    keys = ("date", "machine", "load", "mode", "versions", "counts")
    lines += [f"- {key}: {results.meta[key]}" for key in keys if key in results.meta]
    targets = [
        {
            "measure": v.target.label,
            "value": "n/a" if v.value is None else f"{v.value:.3f} {v.target.unit}".strip(),
            "target": f"{v.target.op} {v.target.limit:g} {v.target.unit}".strip(),
            "result": {None: "n/a", True: "pass", False: "**miss**"}[v.passed]
            + (f" ({v.note})" if v.note else ""),
        }
        for v in results.verdicts
    ]
    lines += ["", "## Targets", "", *markdown_table(targets)]
    names = [n for n in ORDER if n in results.tables]
    for name in names + [n for n in results.tables if n not in names]:
        table = results.tables[name]
        lines += ["", f"## {table.title}"]
        lines += ["", *markdown_table(table.rows)] if table.rows else []
        lines += ["", table.note] if table.note else []
        for link in results.figures.get(name, ()):
            lines += ["", f"![{link.caption}]({link.file})"]
    return "\n".join(lines) + "\n"


def write_reports(results: Results, output_dir: Path, stem: str = "bench") -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = output_dir / f"{stem}.json", output_dir / f"{stem}.md"
    json_path.write_text(json.dumps(results.to_json(), indent=2, ensure_ascii=False) + "\n")
    markdown_path.write_text(render_markdown(results))
    return json_path, markdown_path
