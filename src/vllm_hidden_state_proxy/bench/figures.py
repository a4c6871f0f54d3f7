"""PNG figures of a run, written next to ``bench.md`` and linked after the last table they
illustrate (issue #39; :data:`FIGURES`); a figure whose tables the run left out is not drawn.
The drawing is a small API of plain data (:class:`Bars`, :class:`Lines`, :func:`save_figure`)
that the developer checks (``benchmarks/``) draw theirs with too. matplotlib (the ``bench``
extra) is imported only to save a figure, with the Agg canvas and no pyplot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hidden_state_proxy.bench.report import FigureLink, Results, Table

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Inches and dots per inch of a saved figure: ~1000 x 450 pixels, tens of KB.
SIZE, DPI = (10.0, 4.5), 100
Value = float | int | None


@dataclass(frozen=True)
class Bars:
    """Grouped bars: one group per label of ``groups``, one bar per series in each (a missing
    value leaves a gap); ``labels``: text above a series' bars (a ratio, say)."""

    groups: Sequence[str]
    series: Mapping[str, Sequence[Value]]
    ylabel: str
    title: str = ""
    labels: Mapping[str, Sequence[str | None]] = field(default_factory=dict)
    logy: bool = False


@dataclass(frozen=True)
class Lines:
    """One line with markers per series over ``x`` (a missing value breaks the line)."""

    x: Sequence[float]
    series: Mapping[str, Sequence[Value]]
    xlabel: str
    ylabel: str
    title: str = ""
    logx: bool = False
    logy: bool = False


Panel = Bars | Lines


def save_figure(path: Path, title: str, panels: Sequence[Panel], subtitle: str = "") -> Path:
    """``panels`` side by side under ``title`` (and a smaller ``subtitle``: the machine, the
    model), saved as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=SIZE, layout="constrained")
    FigureCanvasAgg(figure)
    for ax, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        (_draw_bars if isinstance(panel, Bars) else _draw_lines)(ax, panel)  # type: ignore[arg-type]
    figure.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    # No Software entry (it names matplotlib's version) and no date: a file changes only
    # when what it shows does (with one matplotlib).
    figure.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def _numbers(values: Sequence[Value]) -> list[float]:
    return [math.nan if value is None else float(value) for value in values]


def _draw_bars(ax: Axes, bars: Bars) -> None:
    count = max(1, len(bars.series))
    width = 0.8 / count
    for number, (name, values) in enumerate(bars.series.items()):
        offsets = [g + (number - (count - 1) / 2) * width for g in range(len(bars.groups))]
        drawn = ax.bar(offsets, _numbers(values), width, label=name)
        if texts := bars.labels.get(name):
            ax.bar_label(drawn, labels=[t or "" for t in texts], fontsize=8, padding=2)
    ax.set_xticks(range(len(bars.groups)), list(bars.groups), rotation=20, ha="right")
    ax.set_ylabel(bars.ylabel)
    if bars.logy:
        _plain_log_y(ax)
    ax.margins(y=0.12)  # room for the labels above the bars
    _finish(ax, bars.title, axis="y")


def _draw_lines(ax: Axes, lines: Lines) -> None:
    from matplotlib.ticker import NullLocator

    for name, values in lines.series.items():
        ax.plot(list(lines.x), _numbers(values), marker="o", label=name)
    if lines.logx:
        ax.set_xscale("log", base=2)
    if lines.logy:
        _plain_log_y(ax)
    else:
        ax.set_ylim(bottom=0)  # a linear scale from zero: differences at their true size
    # Ticks at the measured points, written as numbers (not 2^k).
    ax.set_xticks(list(lines.x), [f"{x:g}" for x in lines.x])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(lines.xlabel)
    ax.set_ylabel(lines.ylabel)
    _finish(ax, lines.title, axis="both")


def _plain_log_y(ax: Axes) -> None:
    """A log y axis in plain numbers (not 6x10^2), minor ticks labelled at 2 and 5 of each
    decade."""
    from matplotlib.ticker import FuncFormatter

    def two_and_five(value: float, _: object) -> str:
        leading = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0.0
        return f"{value:g}" if round(leading) in (2, 5) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(two_and_five))


def _finish(ax: Axes, title: str, axis: str) -> None:
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, axis=axis, alpha=0.3)  # type: ignore[arg-type]
    ax.legend(fontsize=8)


def table_rows(results: Results, name: str) -> list[dict[str, Any]]:
    return [dict(row) for row in results.tables.get(name, Table(name)).rows]


def column_values(rows: Sequence[Mapping[str, Any]], column: str) -> list[Value]:
    """The numbers of ``column`` (None where a row has none)."""
    values = [row.get(column) for row in rows]
    return [v if isinstance(v, (int, float)) and not isinstance(v, bool) else None for v in values]


def latency_panels(results: Results) -> list[Panel]:
    panels: list[Panel] = []
    if one := table_rows(results, "latency"):
        series = {p: column_values(one, f"{p} ms") for p in ("p50", "p90", "p99")}
        groups = [str(row["arm"]) for row in one]
        panels.append(Bars(groups, series, "latency per request (ms)", "one request at a time"))
    if levels := [row for row in table_rows(results, "throughput") if row.get("concurrency")]:
        arms = ("direct", "passthrough", "flagged")
        panels.append(
            Lines(
                x=[float(row["concurrency"]) for row in levels],
                series={arm: column_values(levels, f"{arm} p50 ms") for arm in arms},
                xlabel="requests in flight",
                ylabel="p50 latency per request (ms)",
                title="by requests in flight",
                logx=True,
                logy=True,  # from ~10 ms alone to hundreds at 64 in flight
            )
        )
    return panels


def extract_panels(results: Results) -> list[Panel]:
    """The extract phase: vectors/s by method and pooling (each bar's number above it)."""
    if not (rows := table_rows(results, "extract_compare")):
        return []
    methods = list(dict.fromkeys(str(row["method"]) for row in rows))
    by_arm = {(row["method"], f"{row.get('input', 'ids')} {row['pooling']}"): row for row in rows}
    series = {
        group: column_values([by_arm.get((m, group), {}) for m in methods], "vectors/s")
        for group in dict.fromkeys(group for _, group in by_arm)
    }
    labels = {p: [None if v is None else f"{v:.0f}" for v in vs] for p, vs in series.items()}
    title = "throughput, same inputs and concurrency"
    return [Bars(methods, series, "vectors / s (log)", title, labels=labels, logy=True)]


@dataclass(frozen=True)
class BenchFigure:
    file: str
    #: The tables it is drawn from: the report links it after the last of them the run has.
    tables: tuple[str, ...]
    title: str
    panels: Callable[[Results], list[Panel]]
    #: What answered, for the subtitle: the run's model, or a fixed upstream.
    upstream: str | None = None


FIGURES = (
    BenchFigure(
        "bench-latency.png",
        ("latency", "throughput"),
        "One-token chat latency: straight to vLLM and through the proxy",
        latency_panels,
    ),
    BenchFigure(
        "extract-throughput.png",
        ("extract_compare",),
        "extract through the proxy against vLLM's pooling server",
        extract_panels,
    ),
)


def subtitle(results: Results, upstream: str | None) -> str:
    meta = results.meta
    parts = [meta.get("host"), upstream or meta.get("model"), str(meta.get("date", ""))[:10]]
    return " · ".join(str(part) for part in parts if part)


def write_figures(
    results: Results, output_dir: Path, figures: Sequence[BenchFigure] = FIGURES
) -> list[Path]:
    """Each figure of ``figures`` whose tables the run has, into ``output_dir``, linked from
    ``results``. A figure the run has no data for is removed there (a stale one from an
    earlier run into the same directory would look like this run's)."""
    written = []
    for figure in figures:
        path = output_dir / figure.file
        if not (panels := figure.panels(results)):
            path.unlink(missing_ok=True)
            continue
        written.append(save_figure(path, figure.title, panels, subtitle(results, figure.upstream)))
        table = [name for name in figure.tables if name in results.tables][-1]
        results.figures.setdefault(table, []).append(FigureLink(figure.file, figure.title))
    return written
