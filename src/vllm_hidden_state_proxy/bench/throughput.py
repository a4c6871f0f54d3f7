"""Throughput arms: requests per second with N one-token requests in flight, for each N of the
sweep: ``direct`` (vLLM), ``passthrough`` and ``flagged`` (through the proxy). At each level the
arms take turns in rounds (round-robin, rotating start), each round a burst of requests per
arm; a ratio of two arms is the median over rounds of their rates in the same round.

The load client is Python on the same 2 cores as vLLM and the proxy: at high concurrency it
competes with them for CPU alike for every arm.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anyio
import anyio.abc
import httpx

from vllm_hidden_state_proxy.bench.client import (
    CHAT_PATH,
    BenchError,
    ChatStack,
    Route,
    chat_body,
    timed_post,
)
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, summarize


def load_routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", "one-token chats straight to vLLM"),
        stack.via_proxy("passthrough", "through the proxy, unflagged"),
        stack.via_proxy("flagged", "through the proxy, flagged (float)", "float"),
    ]


async def burst(
    client: httpx.AsyncClient,
    what: str,
    bodies: Iterator[bytes],
    count: int,
    concurrency: int,
    vector: bool = False,
) -> tuple[float, list[float]]:
    """``count`` chats by ``concurrency`` workers, each answer checked (for a vector too, if
    ``vector``); (wall seconds, per-request seconds). The first failure stops the burst."""
    remaining = count
    latencies: list[float] = []
    failures: list[BenchError] = []

    async def worker(group: anyio.abc.TaskGroup) -> None:
        nonlocal remaining
        while remaining > 0 and not failures:
            remaining -= 1
            try:
                timed = await timed_post(client, CHAT_PATH, next(bodies))
                latencies.append(timed.require_ok(what, vector).seconds)
            except BenchError as failure:
                failures.append(failure)
                group.cancel_scope.cancel()

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(min(concurrency, count)):
            group.start_soon(worker, group)
    if failures:
        raise BenchError(f"{what} at concurrency {concurrency}: {failures[0]}")
    return time.perf_counter() - start, latencies


@dataclass
class _Tally:
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)


async def measure_throughput(
    stack: ChatStack,
    levels: tuple[int, ...],
    rounds: int,
    burst_size: Callable[[int], int],
    progress: Progress,
) -> Table:
    routes = load_routes(stack)
    indices = itertools.count(2_000_000)

    def bodies(route: Route) -> Iterator[bytes]:
        return (chat_body(stack.model, index, flag=route.flag) for index in indices)

    total = sum(burst_size(level) * rounds * len(routes) for level in levels)
    task = progress.task(f"throughput (concurrency {', '.join(map(str, levels))})", total)
    rows: list[Row] = []
    for level in levels:
        clients = {route.name: stack.client(route, level) for route in routes}
        tallies = {route.name: _Tally() for route in routes}
        try:
            for route in routes:  # open the connections and warm up, not recorded
                await burst(clients[route.name], route.name, bodies(route), level, level)
            for _, route in round_robin(routes, rounds):
                count = burst_size(level)
                vector = route.flag is not None
                seconds, latencies = await burst(
                    clients[route.name], route.name, bodies(route), count, level, vector
                )
                tally = tallies[route.name]
                tally.requests += count
                tally.seconds += seconds
                tally.latencies.extend(latencies)
                tally.rates.append(count / seconds)
                task.advance(count)
        finally:
            for client in clients.values():
                await client.aclose()
        direct, passthrough, flagged = (tallies[route.name] for route in routes)
        rows.append(
            {
                "concurrency": level,
                "direct req/s": direct.requests / direct.seconds,
                "passthrough req/s": passthrough.requests / passthrough.seconds,
                "flagged req/s": flagged.requests / flagged.seconds,
                "passthrough / direct": median_ratio(passthrough.rates, direct.rates),
                "flagged / direct": median_ratio(flagged.rates, direct.rates),
                "direct p50 ms": summarize(direct.latencies, 1e3).p50,
                "flagged p50 ms": summarize(flagged.latencies, 1e3).p50,
                "requests per arm": direct.requests,
            }
        )
    task.done()
    return Table(
        "Throughput: one-token chats, N in flight",
        rows,
        "Rates: all of an arm's requests over all its seconds. Ratios: the median over rounds "
        "of the two arms' rates in the same round (they ran side by side).",
    )
