"""One-token chats, one at a time: the latency arms (interleaved round-robin) and the CPU time
each kind of request costs the proxy and vLLM (arms one after the other).

- ``direct``: straight to vLLM, unflagged (the baseline).
- ``passthrough``: the same request through the proxy, unflagged.
- ``flagged_float``: through the proxy with ``return_last_hidden_state`` (JSON float list).
- ``flagged_base64``: the same with ``last_hidden_state_format: "base64"``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Route
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table, summary_cells
from vllm_hidden_state_proxy.bench.stats import ratio, summarize
from vllm_hidden_state_proxy.bench.turns import take_turns


def routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", "one-token chat straight to vLLM, unflagged"),
        stack.via_proxy("passthrough", "the same through the proxy, unflagged"),
        stack.via_proxy("flagged_float", "through the proxy, flagged: vector as floats", "float"),
        stack.via_proxy("flagged_base64", "through the proxy, flagged: vector as base64", "base64"),
    ]


async def measure_latency(
    stack: ChatStack, requests: int, warmup: int, progress: Progress
) -> Table:
    arms = routes(stack)
    indices = itertools.count()
    samples: dict[str, list[float]] = {route.name: [] for route in arms}

    async def warm_up(client: httpx.AsyncClient, route: Route) -> None:
        await stack.chat_request(client, route, indices)()

    async def turn(client: httpx.AsyncClient, route: Route, _: int) -> int:
        samples[route.name].append(await stack.chat_request(client, route, indices)())
        return 1

    task = progress.task("latency (one request at a time, arms interleaved)", requests * len(arms))
    await take_turns(
        arms, stack.client, turn, requests, task, warm_up=warm_up, warm_up_rounds=warmup
    )
    task.done()
    summaries = {name: summarize(values, 1e3) for name, values in samples.items()}
    rows: list[Row] = []
    for route in arms:
        p50 = summaries[route.name].p50
        rows.append(
            {"arm": route.name, "what": route.description, **summary_cells(summaries[route.name])}
        )
        rows[-1]["p50 / direct"] = ratio(p50, summaries["direct"].p50)
        if route.flag is not None:
            rows[-1]["p50 / passthrough"] = ratio(p50, summaries["passthrough"].p50)
    title = "Latency: one-token chat, one request at a time, arms interleaved"
    return Table(title, rows)


async def measure_cpu(
    stack: ChatStack,
    requests: int,
    proxy_cpu: Callable[[], float] | None,
    vllm_cpu: Callable[[], float] | None,
    progress: Progress,
) -> Table:
    """CPU milliseconds per request of each latency arm, from readings of the proxy's and
    vLLM's CPU clocks (None: not on this machine) around the arm's requests, back to back."""
    indices = itertools.count(3_000_000)
    clocks = (proxy_cpu, vllm_cpu)
    rows: list[Row] = []
    task = progress.task("CPU time per request (arms one after the other)", requests * 4)
    for route in routes(stack):
        async with stack.client(route) as client:
            chat = stack.chat_request(client, route, indices)
            await chat()  # connect
            before = [clock() if clock else 0.0 for clock in clocks]
            for _ in range(requests):
                await chat()
                task.advance()
            spent = [
                clock() - b if clock else None for clock, b in zip(clocks, before, strict=True)
            ]
        proxy_ms, vllm_ms = (None if s is None else 1e3 * s / requests for s in spent)
        rows.append(
            {
                "arm": route.name,
                "requests": requests,
                "proxy CPU ms": proxy_ms,
                "vLLM CPU ms": vllm_ms,
            }
        )
    task.done()
    return Table(
        "CPU time per request (arms one after the other)",
        rows,
        "vLLM: its API server, engine core and workers together.",
    )
