"""Throughput arms: requests per second with N one-token requests in flight, for each N of the
sweep, ``throughput_direct`` (vLLM), ``throughput_passthrough`` and ``throughput_flagged``
(through the proxy). For every level the arms take turns in rounds (round-robin, rotating
start); an arm's rate is all its requests over all its seconds at that level, and its rate in
each round is kept too: a ratio of two arms' rates in the same round compares them under the
same conditions, and the median of those paired ratios shrugs off a noisy round.

The load client is Python on the same 2 cores as vLLM and the proxy: at high concurrency it
competes with them for CPU alike for every arm.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc
import httpx

from vllm_hidden_state_proxy.bench.client import (
    CHAT_PATH,
    BenchError,
    chat_body,
    new_client,
    timed_post,
)
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.latency import Route
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import ThroughputArm, ThroughputPoint
from vllm_hidden_state_proxy.bench.stats import summarize

THROUGHPUT_DIRECT = "throughput_direct"
THROUGHPUT_PASSTHROUGH = "throughput_passthrough"
THROUGHPUT_FLAGGED = "throughput_flagged"
VECTOR_MARKER = b'"last_hidden_state"'


def load_routes(vllm_url: str, proxy_url: str, proxy_key: str | None = None) -> list[Route]:
    return [
        Route(THROUGHPUT_DIRECT, "one-token chats straight to vLLM, N in flight", vllm_url),
        Route(
            THROUGHPUT_PASSTHROUGH,
            "the same through the proxy, unflagged",
            proxy_url,
            api_key=proxy_key,
        ),
        Route(
            THROUGHPUT_FLAGGED,
            "the same through the proxy, flagged (float)",
            proxy_url,
            "float",
            proxy_key,
        ),
    ]


@dataclass
class _Tally:
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rounds_rps: list[float] = field(default_factory=list)


async def _burst(
    client: httpx.AsyncClient,
    route: Route,
    model: str,
    count: int,
    concurrency: int,
    indices: itertools.count[int],
) -> tuple[float, list[float]]:
    """``count`` requests by ``concurrency`` workers; (wall seconds, per-request latencies)."""
    remaining = count
    latencies: list[float] = []
    failures: list[BenchError] = []

    async def worker(group: anyio.abc.TaskGroup) -> None:
        nonlocal remaining
        while remaining > 0 and not failures:
            remaining -= 1
            try:
                timed = await timed_post(
                    client, CHAT_PATH, chat_body(model, next(indices), flag=route.flag)
                )
                timed.require_ok(f"{route.name} request")
                # A byte search, not a parse: the client's work stays the same for every arm.
                if route.flag is not None and VECTOR_MARKER not in timed.body:
                    raise BenchError(f"{route.name}: a flagged response without its vector")
            except BenchError as failure:
                failures.append(failure)
                group.cancel_scope.cancel()
                return
            latencies.append(timed.seconds)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(min(concurrency, count)):
            group.start_soon(worker, group)
    if failures:
        raise BenchError(f"{route.name} at concurrency {concurrency}: {failures[0]}")
    return time.perf_counter() - start, latencies


async def measure_throughput(
    routes: list[Route],
    model: str,
    levels: tuple[int, ...],
    rounds: int,
    burst: Callable[[int], int],
    progress: Progress,
    first_index: int = 2_000_000,
) -> list[ThroughputArm]:
    indices = itertools.count(first_index)
    arms = {route.name: ThroughputArm(route.name, route.description) for route in routes}
    total = sum(burst(level) * rounds * len(routes) for level in levels)
    task = progress.task(f"throughput (concurrency {', '.join(map(str, levels))})", total)
    for level in levels:
        clients = {route.name: new_client(route.base_url, level, route.api_key) for route in routes}
        tallies = {route.name: _Tally() for route in routes}
        try:
            for route in routes:  # open the connections and warm up, not recorded
                await _burst(clients[route.name], route, model, level, level, indices)
            for _, route in round_robin(routes, rounds):
                count = burst(level)
                seconds, latencies = await _burst(
                    clients[route.name], route, model, count, level, indices
                )
                tally = tallies[route.name]
                tally.requests += count
                tally.seconds += seconds
                tally.latencies.extend(latencies)
                tally.rounds_rps.append(count / seconds)
                task.advance(count)
        finally:
            for client in clients.values():
                await client.aclose()
        for route in routes:
            tally = tallies[route.name]
            arms[route.name].points.append(
                ThroughputPoint(
                    concurrency=level,
                    requests=tally.requests,
                    seconds=tally.seconds,
                    requests_per_second=tally.requests / tally.seconds,
                    latency_ms=summarize(tally.latencies, 1e3),
                    rounds_rps=tally.rounds_rps,
                )
            )
    task.done()
    return [arms[route.name] for route in routes]
