"""``python -m benchmarks [--checks ring,hop,matrices,layers,beside] [--smoke] [--output-dir DIR]``
(``make bench-micro``): the developer checks, in that order; the report is ``micro.md`` and
``micro.json`` beside ``hidden-state-proxy bench``'s, with ``bench-cpu.png`` and
``bench-matrix-cost.png``."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.beside import ORDINARY_CONCURRENCY, measure_beside
from benchmarks.instant import measure_instant, measure_instant_throughput
from benchmarks.layers_cost import KINDS, LAYERS, VISITS, layers_table, measure_visit
from benchmarks.matrices import MAX_PULLS, MIN_PULLS, run_matrix_arm, run_size_sweep
from benchmarks.report import FIGURES, TARGETS, redraw
from benchmarks.ring_micro import measure_ring
from benchmarks.servers import instant_stack
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.figures import write_figures
from vllm_hidden_state_proxy.bench.main import host_meta
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Results, evaluate, render_markdown, write_reports
from vllm_hidden_state_proxy.bench.servers import chat_stack, vllm_lock
from vllm_hidden_state_proxy.bench.turns import Tally, run_async
from vllm_hidden_state_proxy.bench.usage import tree_cpu_seconds
from vllm_hidden_state_proxy.tiny_model import build_tiny_model

CHECKS = ("ring", "hop", "matrices", "layers", "beside")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--checks", default=",".join(CHECKS), help="default %(default)s")
    parser.add_argument("--smoke", action="store_true", help="seconds, not minutes")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--model-dir", type=Path, help="the tiny model's cache (layers)")
    parser.add_argument("--matrix-mib", type=int, help="the matrix arm's size (64; smoke 4)")
    parser.add_argument("--matrix-sizes", help="the size sweep's MiB (1,4,16,64; smoke 1,4)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument(
        "--redraw", action="store_true", help="only draw the figures of --output-dir's reports"
    )
    return parser


def measure_hop(output_dir: Path, requests: int, rounds: int, progress: Progress) -> Results:
    """The proxies in front of the instant upstream, against that upstream alone."""
    results = Results({})
    with instant_stack(output_dir, progress) as stack:
        app, proxies = stack.app, stack.proxies
        single = [proxy for proxy in proxies if "workers" not in proxy.label]  # one process
        results.tables["instant"] = run_async(
            measure_instant(app, single, requests, rounds, progress)
        )
        # The default, and the one that answers "what if more requests are in flight": more
        # worker processes.
        in_flight = [proxies[0], *(p for p in proxies if "workers" in p.label)]
        results.tables["instant_throughput"] = run_async(
            measure_instant_throughput(app, in_flight, requests, rounds, progress)
        )
    return results


def measure_layers(
    args: argparse.Namespace, requests: int, rounds: int, progress: Progress
) -> Results:
    """One server at a time, without and with every layer captured (the lock is held)."""
    model_dir = build_tiny_model(args.model_dir)
    tallies = {(server, kind): Tally() for server in VISITS for kind, _ in KINDS}
    with vllm_lock(progress):
        for number, server in enumerate(VISITS):
            serve_args = ("--hidden-state-layers", LAYERS) if server == "with" else ()
            with chat_stack(
                model_dir,
                args.output_dir,
                args.startup_timeout,
                progress,
                serve_args=serve_args,
                name=f"layers-{number}-{server}",
            ) as stack:
                cpu = None if stack.pid is None else functools.partial(tree_cpu_seconds, stack.pid)
                run_async(
                    measure_visit(
                        stack,
                        {kind: tallies[(server, kind)] for kind, _ in KINDS},
                        requests,
                        max(1, rounds // 2),
                        cpu,
                        progress,
                    )
                )
    return Results({}, {"layers": layers_table(tallies)})


def measure_beside_flagged(
    args: argparse.Namespace, burst: int, rounds: int, progress: Progress
) -> Results:
    """Ordinary traffic beside flagged traffic of each kind, on one ``serve`` of the tiny
    model (the lock is held)."""
    model_dir = build_tiny_model(args.model_dir)
    timeout = args.startup_timeout
    with vllm_lock(progress), chat_stack(model_dir, args.output_dir, timeout, progress) as stack:
        table = run_async(measure_beside(stack, rounds, burst, progress))
    return Results({}, {"beside": table})


def run(args: argparse.Namespace, checks: Sequence[str], progress: Progress) -> Results:
    smoke = args.smoke
    rounds = 1 if smoke else 6
    results = Results(host_meta(), title="hidden-state-proxy developer checks")
    results.meta["mode"] = "checks: " + ",".join(checks) + (" (smoke)" if smoke else "")
    if "ring" in checks:
        results.tables.update(measure_ring(200 if smoke else 3000, progress))
    if "hop" in checks:
        hop = measure_hop(args.output_dir, 200 if smoke else 2000, rounds, progress)
        results.tables.update(hop.tables)
    if "matrices" in checks:
        mib = args.matrix_mib or (4 if smoke else 64)
        sizes = args.matrix_sizes or ("1,4" if smoke else "1,4,16,64")
        results.tables["matrices"] = run_matrix_arm(
            args.output_dir,
            mib,
            pulls=2 if smoke else 8,
            pulls_beside=1 if smoke else 3,
            rounds=1 if smoke else 3,
            progress=progress,
        )
        results.tables["matrix_sizes"] = run_size_sweep(
            args.output_dir,
            [int(size) for size in sizes.split(",")],
            progress,
            MIN_PULLS if smoke else MAX_PULLS,
        )
    if "layers" in checks:
        layers = measure_layers(args, 9 if smoke else 600, rounds, progress)
        results.tables.update(layers.tables)
    if "beside" in checks:
        # Ordinary requests a turn: as the bench's throughput phase sends at that concurrency
        # (--requests 200 over the rounds).
        burst = ORDINARY_CONCURRENCY if smoke else max(2 * ORDINARY_CONCURRENCY, -(-200 // rounds))
        results.tables.update(measure_beside_flagged(args, burst, rounds, progress).tables)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.redraw:
        for stem in ("bench", "micro"):
            if (args.output_dir / f"{stem}.json").exists():
                print(*redraw(args.output_dir, stem=stem), sep="\n")
        return 0
    checks = [check.strip() for check in args.checks.split(",") if check.strip()]
    progress = Progress()
    if unknown := sorted(set(checks) - set(CHECKS)):
        progress.say(f"unknown checks {', '.join(unknown)}: choose from {', '.join(CHECKS)}")
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, checks, progress)
    except BenchError as problem:
        progress.say(f"failed: {problem}")
        return 1
    evaluate(results, TARGETS)
    try:
        write_figures(results, args.output_dir, FIGURES)
    except ImportError as missing:
        progress.say(f"no figures: {missing}")
    json_path, markdown_path = write_reports(results, args.output_dir, "micro")
    sys.stdout.write(render_markdown(results))
    progress.say(f"wrote {markdown_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
