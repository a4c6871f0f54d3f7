"""The report's figures (bench/figures.py): PNGs from plain data, linked after their tables, and
none (nor a link) for a phase the run left out. The developer checks' figures
(benchmarks/report.py) stand beside the bench's here: one drawing code serves both."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from benchmarks.report import redraw

from benchmarks import report as micro
from vllm_hidden_state_proxy.bench import figures
from vllm_hidden_state_proxy.bench.figures import (
    Bars,
    Lines,
    save_figure,
    subtitle,
    write_figures,
)
from vllm_hidden_state_proxy.bench.report import Results, Table, render_markdown, write_reports

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: The bench's figures and the developer checks'.
FIGURES = (*figures.FIGURES, *micro.FIGURES)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def assert_figure(path: Path) -> None:
    width, height = png_size(path)
    assert (width, height) == (1000, 450)  # figures.SIZE at figures.DPI
    # Drawn, not blank: a blank 1000 x 450 canvas compresses to a few KB.
    assert 15_000 < path.stat().st_size < 150_000, path.stat().st_size


def sample() -> Results:
    """Every table a figure reads, with small made-up numbers."""
    results = Results(
        meta={
            "date": "2026-12-03T22:00:00+00:00",
            "host": "2 CPU cores (AMD EPYC), no GPU",
            "model": "vLLM (CPU build) on the tiny offline model",
        }
    )
    arms = (("direct", 1.0), ("passthrough", 1.1), ("flagged_float", 1.17))
    results.tables["latency"] = Table(
        "Latency",
        [{"arm": a, "p50 ms": 8.5 * f, "p90 ms": 10 * f, "p99 ms": 14 * f} for a, f in arms],
    )
    results.tables["throughput"] = Table(
        "Throughput",
        [
            {
                "concurrency": c,
                "direct p50 ms": 8.0 + c,
                "passthrough p50 ms": 9.0 + c,
                "flagged p50 ms": None if c == 64 else 10.0 + c,  # a gap in the line
            }
            for c in (1, 4, 16, 64)
        ],
    )
    results.tables["instant"] = Table(
        "The hop alone",
        [
            {"arm": "direct", "app CPU ms/request": 0.15},
            {"arm": "passthrough", "proxy CPU ms/request": 0.66, "proxy / app CPU": 4.4},
            {"arm": "flagged", "proxy CPU ms/request": 0.8, "proxy / app CPU": 5.3},
            {"arm": "stream_direct", "app CPU ms/request": 0.17},
            {"arm": "stream_passthrough", "proxy CPU ms/request": 0.73, "proxy / app CPU": 4.3},
        ],
    )
    results.tables["matrix_sizes"] = Table(
        "Matrix size against cost",
        [
            {
                "matrix MiB": m,
                "pull p50 ms": 8.0 + 15 * m,
                "proxy CPU ms/matrix": 4.0 + m,
                "MB/s of rows": 100.0 + m,
            }
            for m in (1, 4, 16, 64)
        ],
    )
    return results


def test_every_figure_is_a_png_linked_after_the_table_it_illustrates(tmp_path: Path) -> None:
    results = sample()
    written = write_figures(results, tmp_path, FIGURES)
    assert [path.name for path in written] == [
        "bench-latency.png",
        "bench-cpu.png",
        "bench-matrix-cost.png",
    ]
    for path in written:
        assert_figure(path)
    json_path, markdown_path = write_reports(results, tmp_path)
    markdown = markdown_path.read_text()
    sections = {part.split("\n", 1)[0]: part for part in markdown.split("\n## ")}
    assert "](bench-latency.png)" in sections["Throughput"]
    assert "](bench-cpu.png)" in sections["The hop alone"]
    assert "](bench-matrix-cost.png)" in sections["Matrix size against cost"]
    assert markdown.count("![") == 3
    document = json.loads(json_path.read_text())
    assert document["figures"]["instant"] == [
        {"file": "bench-cpu.png", "caption": micro.FIGURES[0].title}
    ]


def test_a_run_is_drawn_again_from_its_json(tmp_path: Path) -> None:
    results = sample()
    write_figures(results, tmp_path, FIGURES)
    write_reports(results, tmp_path)
    first = {path.name: path.read_bytes() for path in tmp_path.glob("*.png")}
    for path in tmp_path.glob("*.png"):
        path.unlink()
    assert {path.name: path.read_bytes() for path in redraw(tmp_path, FIGURES)} == first


def test_a_phase_left_out_has_no_figure_and_no_link(tmp_path: Path) -> None:
    write_figures(sample(), tmp_path, FIGURES)  # an earlier run into the same directory
    results = sample()
    results.tables["instant"] = Table("The hop alone", note="skipped")
    del results.tables["matrix_sizes"]
    written = write_figures(results, tmp_path, FIGURES)
    assert [path.name for path in written] == ["bench-latency.png"]
    assert not (tmp_path / "bench-cpu.png").exists()  # the stale one is gone too
    assert not (tmp_path / "bench-matrix-cost.png").exists()
    markdown = render_markdown(results)
    assert "bench-cpu.png" not in markdown and "bench-matrix-cost.png" not in markdown
    assert "](bench-latency.png)" in markdown


def test_latency_alone_still_draws_its_figure_from_one_table(tmp_path: Path) -> None:
    results = sample()
    del results.tables["throughput"]
    (path, *_) = write_figures(results, tmp_path)
    assert path.name == "bench-latency.png"
    assert_figure(path)
    assert "](bench-latency.png)" in render_markdown(results).split("## Latency")[1]


def test_nothing_measured_nothing_drawn(tmp_path: Path) -> None:
    results = Results(meta={})
    assert write_figures(results, tmp_path) == []
    assert list(tmp_path.iterdir()) == [] and results.figures == {}


def test_the_drawing_api_takes_plain_data_gaps_included(tmp_path: Path) -> None:
    path = save_figure(
        tmp_path / "sub" / "any.png",
        "Any comparison",
        [
            Bars(
                groups=["a", "b"],
                series={"one": [1.0, None], "two": [2, 3]},
                ylabel="s",
                labels={"two": ["x", None]},
            ),
            Lines(x=[1, 10], series={"l": [None, 5.0]}, xlabel="n", ylabel="ms", logy=True),
        ],
        subtitle="the machine · the model",
    )
    assert_figure(path)
    # The same data, the same bytes (no version or date in the file).
    again = save_figure(tmp_path / "again.png", "Any comparison", [Bars(["a"], {"x": [1]}, "s")])
    assert (
        again.read_bytes()
        == save_figure(
            tmp_path / "again2.png", "Any comparison", [Bars(["a"], {"x": [1]}, "s")]
        ).read_bytes()
    )


def test_the_subtitle_names_the_machine_the_upstream_and_the_day() -> None:
    results = sample()
    assert subtitle(results, None) == (
        "2 CPU cores (AMD EPYC), no GPU · vLLM (CPU build) on the tiny offline model · 2026-12-03"
    )
    assert "instant upstream" in subtitle(results, micro.FIGURES[0].upstream or "")
    assert subtitle(Results(meta={}), None) == ""


def test_without_matplotlib_the_bench_says_so_and_still_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from vllm_hidden_state_proxy.bench import main as bench_main
    from vllm_hidden_state_proxy.cli import build_parser

    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib...: ImportError
    monkeypatch.setattr(bench_main, "run", lambda options, progress: sample())
    args = build_parser().parse_args(["bench", "--smoke", "--output-dir", str(tmp_path)])
    assert bench_main.run_bench(args) == 0
    assert "no figures" in capsys.readouterr().err
    assert (tmp_path / "bench.md").exists() and not list(tmp_path.glob("*.png"))
    assert "![" not in (tmp_path / "bench.md").read_text()
