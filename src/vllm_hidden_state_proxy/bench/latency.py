"""One-token chats, one at a time, arms interleaved round-robin: ``direct`` (straight to vLLM,
unflagged: the baseline), ``direct_hooked`` (straight to vLLM with a request key for the worker
hook, which captures and publishes a vector nobody reads: the hook's cost inside vLLM),
``passthrough`` (the same through the proxy), ``flagged_float`` and ``flagged_base64``
(flagged, the vector as a JSON float list or as base64). :func:`one_at_a_time`
is the loop (the answers phase's too).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Route, timed_post
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table, summary_cells
from vllm_hidden_state_proxy.bench.stats import Summary, ratio, summarize
from vllm_hidden_state_proxy.bench.turns import take_turns
from vllm_hidden_state_proxy.protocol import CHAT_PATH


def routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", "one-token chat straight to vLLM, unflagged"),
        stack.direct("direct_hooked", "the same with a request key for the hook", hooked=True),
        stack.via_proxy("passthrough", "the same through the proxy, unflagged"),
        stack.via_proxy("flagged_float", "through the proxy, flagged: vector as floats", "float"),
        stack.via_proxy("flagged_base64", "through the proxy, flagged: vector as base64", "base64"),
    ]


async def one_at_a_time(
    stack: ChatStack,
    arms: Sequence[Route],
    requests: int,
    warmup: int,
    progress: Progress,
    *,
    what: str,
    first_index: int = 0,
    max_tokens: int = 1,
) -> dict[str, tuple[Summary, int]]:
    """``warmup`` requests per arm, then ``requests``, one at a time, the arms taking turns
    request by request: each arm's latency (ms) and the mean bytes of its answers."""
    indices = itertools.count(first_index)
    samples: dict[str, list[float]] = {route.name: [] for route in arms}
    sizes: dict[str, list[int]] = {route.name: [] for route in arms}

    async def warm_up(client: httpx.AsyncClient, route: Route) -> None:
        await stack.chat_request(client, route, indices, max_tokens)()

    async def turn(client: httpx.AsyncClient, route: Route, _: int) -> int:
        body = stack.chat_body(route, next(indices), max_tokens)
        timed = await timed_post(client, CHAT_PATH, body)
        timed.require_ok(route.name, route.flag is not None)
        samples[route.name].append(timed.seconds)
        sizes[route.name].append(len(timed.body))
        return 1

    task = progress.task(f"{what} (one request at a time, arms interleaved)", requests * len(arms))
    await take_turns(
        arms, stack.client, turn, requests, task, warm_up=warm_up, warm_up_rounds=warmup
    )
    task.done()
    return {
        name: (summarize(values, 1e3), sum(sizes[name]) // max(len(sizes[name]), 1))
        for name, values in samples.items()
    }


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    arms, requests = routes(stack), options.requests
    found = await one_at_a_time(stack, arms, requests, options.warmup, progress, what="latency")
    rows: list[Row] = []
    for route in arms:
        summary = found[route.name][0]
        rows.append({"arm": route.name, "what": route.description, **summary_cells(summary)})
        rows[-1]["p50 / direct"] = ratio(summary.p50, found["direct"][0].p50)
        if route.flag is not None:
            rows[-1]["p50 / passthrough"] = ratio(summary.p50, found["passthrough"][0].p50)
    title = "Latency: one-token chat, one request at a time, arms interleaved"
    return Table(title, rows)
