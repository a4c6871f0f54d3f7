"""Requests per second with N one-token chats in flight, for each N of ``--concurrency``:
``direct`` (vLLM), ``passthrough`` and ``flagged`` (through the proxy), taking turns burst by
burst in rounds. The load client runs on the same cores as vLLM and the proxy: at high
concurrency it competes with them for CPU alike for every arm.
"""

from __future__ import annotations

import itertools

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Route
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, summarize
from vllm_hidden_state_proxy.bench.turns import Tally, burst, burst_turn, take_turns


def load_routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", "one-token chats straight to vLLM"),
        stack.via_proxy("passthrough", "through the proxy, unflagged"),
        stack.via_proxy("flagged", "through the proxy, flagged (float)", "float"),
    ]


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    """At each ``--concurrency`` level, ``options.rounds`` rounds of a burst per arm (of
    ``options.throughput_burst(level)`` requests); an arm is a route at a level, its own
    connections opened by a warm-up burst."""
    levels, rounds, burst_size = options.concurrency, options.rounds, options.throughput_burst
    routes = load_routes(stack)
    indices = itertools.count(2_000_000)
    tallies = {(route.name, level): Tally() for level in levels for route in routes}

    async def warm_up(client: httpx.AsyncClient, arm: tuple[Route, int]) -> None:
        route, level = arm
        await burst(stack.chat_request(client, route, indices), route.name, level, level)

    async def turn(client: httpx.AsyncClient, arm: tuple[Route, int], _: int) -> int:
        route, level = arm
        chats = stack.chat_request(client, route, indices)
        return await burst_turn(
            tallies[route.name, level], chats, route.name, burst_size(level), level
        )

    def client(arm: tuple[Route, int]) -> httpx.AsyncClient:
        return stack.client(*arm)

    total = sum(burst_size(level) * rounds * len(routes) for level in levels)
    task = progress.task(f"throughput (concurrency {', '.join(map(str, levels))})", total)
    rows: list[Row] = []
    for level in levels:
        arms = [(route, level) for route in routes]
        await take_turns(arms, client, turn, rounds, task, warm_up=warm_up)
        direct, passthrough, flagged = (tallies[route.name, level] for route in routes)
        rows.append(
            {
                "concurrency": level,
                "direct req/s": direct.rate,
                "passthrough req/s": passthrough.rate,
                "flagged req/s": flagged.rate,
                "passthrough / direct": median_ratio(passthrough.rates, direct.rates),
                "flagged / direct": median_ratio(flagged.rates, direct.rates),
                "direct p50 ms": summarize(direct.latencies, 1e3).p50,
                "passthrough p50 ms": summarize(passthrough.latencies, 1e3).p50,
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
