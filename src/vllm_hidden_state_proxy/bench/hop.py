"""The hop: the CPU time each kind of one-token chat costs the proxy, beside what it costs
vLLM (its API server, engine core and workers), arm by arm, the latency phase's arms one after
the other (CPU accounting hardly depends on what else runs). Its floor against a bare uvicorn
app, without vLLM, is a developer check (``benchmarks/instant.py``).
"""

from __future__ import annotations

import itertools

from vllm_hidden_state_proxy.bench.client import ChatStack
from vllm_hidden_state_proxy.bench.latency import routes
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    """CPU milliseconds per request of each latency arm, from readings of the proxy's and
    vLLM's CPU clocks (None: not on this machine) around the arm's requests, back to back."""
    indices, requests = itertools.count(3_000_000), options.cpu_requests
    clocks = (stack.proxy_cpu, stack.vllm_cpu)
    rows: list[Row] = []
    arms = routes(stack)
    task = progress.task("CPU time per request (arms one after the other)", requests * len(arms))
    for route in arms:
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
