"""The developer checks' targets and figures (``benchmarks/__main__.py`` runs the checks): the
same report types as ``hidden-state-proxy bench``'s, for the tables only these checks write;
and :func:`redraw`, a run's figures drawn again from its JSON (after a change to the drawing,
without running anything again: ``python -m benchmarks --redraw DIR``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vllm_hidden_state_proxy.bench import figures as bench_figures
from vllm_hidden_state_proxy.bench.figures import (
    Bars,
    BenchFigure,
    Lines,
    Panel,
    Value,
    column_values,
    table_rows,
    write_figures,
)
from vllm_hidden_state_proxy.bench.report import Results, Table, Target

TARGETS = (
    Target(
        "ring publish + lookup p50, 4096-d",
        "ring",
        4096,
        "publish + lookup p50 µs",
        "<=",
        50.0,
        "µs",
    ),
    Target(
        "ordinary p99 rise beside 64 MiB matrices",
        "matrices",
        "ordinary p99 rise ms",
        "value",
        "<=",
        50.0,
        "ms",
    ),
    Target(
        "proxy RSS over idle + --vectors-budget",
        "matrices",
        "peak - idle - budget MiB (<= 0: within the bound)",
        "value",
        "<=",
        0.0,
        "MiB",
    ),
    Target(
        "passthrough: proxy CPU / bare app's",
        "instant",
        "passthrough",
        "proxy / app CPU",
        "<=",
        3.0,
    ),
    Target("flagged: proxy CPU / bare app's", "instant", "flagged", "proxy / app CPU", "<=", 3.5),
    Target(
        "--hidden-state-layers: req/s with / without",
        "layers",
        "unflagged",
        "with / without",
        ">=",
        0.97,
    ),
)


def cpu_panels(results: Results) -> list[Panel]:
    rows = table_rows(results, "instant")
    app = {row["arm"]: row.get("app CPU ms/request") for row in rows}
    via_proxy = [row for row in rows if row.get("proxy CPU ms/request") is not None]
    if not via_proxy:
        return []

    def baseline(arm: str) -> Value:
        value = app.get("stream_direct" if arm.startswith("stream") else "direct")
        return value if isinstance(value, (int, float)) else None

    ratios = column_values(via_proxy, "proxy / app CPU")
    return [
        Bars(
            groups=[str(row["arm"]) for row in via_proxy],
            series={
                "proxy": column_values(via_proxy, "proxy CPU ms/request"),
                "bare uvicorn app (its direct arm)": [baseline(str(r["arm"])) for r in via_proxy],
            },
            ylabel="CPU time per request (ms)",
            labels={"proxy": [None if r is None else f"{r:.1f}×" for r in ratios]},
        )
    ]


def matrix_panels(results: Results) -> list[Panel]:
    rows = table_rows(results, "matrix_sizes")
    if not rows:
        return []
    sizes = [float(row["matrix MiB"]) for row in rows]
    return [
        Lines(
            x=sizes,
            series={
                "pull, client-side (p50)": column_values(rows, "pull p50 ms"),
                "proxy CPU": column_values(rows, "proxy CPU ms/matrix"),
            },
            xlabel="matrix size (MiB of float32)",
            ylabel="ms per matrix",
            title="time and CPU per matrix",
            logx=True,
            logy=True,
        ),
        Lines(
            x=sizes,
            series={"one client": column_values(rows, "MB/s of rows")},
            xlabel="matrix size (MiB of float32)",
            ylabel="matrix rows served (MB/s)",
            title="throughput",
            logx=True,
        ),
    ]


INSTANT = "instant upstream (a bare uvicorn app, no vLLM)"
FIGURES = (
    BenchFigure(
        "bench-cpu.png",
        ("instant",),
        "Proxy CPU per request against a bare uvicorn app (ratio above the bars)",
        cpu_panels,
        INSTANT,
    ),
    BenchFigure(
        "bench-matrix-cost.png",
        ("matrix_sizes",),
        "Matrix size against cost: one client pulling all_prompt matrices (base64)",
        matrix_panels,
        INSTANT,
    ),
)


def redraw(
    output_dir: Path,
    figures: Sequence[BenchFigure] = (*bench_figures.FIGURES, *FIGURES),
    stem: str = "bench",
) -> list[Path]:
    """The figures of the run whose ``{stem}.json`` is in ``output_dir``, drawn again."""
    document = json.loads((output_dir / f"{stem}.json").read_text())
    tables = {name: Table(**table) for name, table in document["tables"].items()}
    return write_figures(Results(document["meta"], tables), output_dir, figures)
