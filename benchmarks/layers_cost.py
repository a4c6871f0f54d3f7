"""What capturing layers costs all traffic (issue #14): the tiny model served without and with
``--hidden-state-layers`` (every layer), one server at a time, in the order without, with,
without, with (a slow drift of the machine falls on both alike). Each server gets unflagged and
flagged (final layer, the default request) one-token chats, one at a time, burst by burst in
turns: requests per second, and the CPU time of the server's processes (vLLM and the proxy) per
request.

Not two servers side by side: on 2 cores, two identical servers compared that way differed by
up to 45% (with the one not measured stopped, too). Not with many requests in flight: with 16,
single bursts of one server ran at anything from 90 to 250 requests per second, as vLLM's
batches happened to form; one at a time, the rate measures what every request costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Flag, Route
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import ratio
from vllm_hidden_state_proxy.bench.turns import Tally, burst, burst_turn, take_turns

CONCURRENCY = 1
#: Requests per kind before a visit's measurement (connections, first batches).
WARMUP = 16
#: Every layer of the two-layer tiny model: the most a server can capture.
LAYERS = "0,1,-1"
#: The servers, in the order they run.
VISITS = ("without", "with", "without", "with")
KINDS: tuple[tuple[str, Flag], ...] = (("unflagged", None), ("flagged", "float"))


async def measure_visit(
    stack: ChatStack,
    tallies: dict[str, Tally],
    requests: int,
    rounds: int,
    cpu: Callable[[], float] | None,
    progress: Progress,
) -> None:
    """``requests`` per kind on one server, in ``rounds`` bursts each, kinds taking turns."""
    indices = itertools.count(4_000_000)
    count = max(CONCURRENCY, requests // rounds)
    routes = [stack.via_proxy(kind, kind, flag) for kind, flag in KINDS]

    async def warm_up(client: httpx.AsyncClient, route: Route) -> None:
        await burst(stack.chat_request(client, route, indices), route.name, WARMUP, CONCURRENCY)

    async def turn(client: httpx.AsyncClient, route: Route, _: int) -> int:
        chats = stack.chat_request(client, route, indices)
        return await burst_turn(tallies[route.name], chats, route.name, count, CONCURRENCY, cpu)

    def client(route: Route) -> httpx.AsyncClient:
        return stack.client(route, CONCURRENCY)

    task = progress.task("layers cost (one request at a time)", count * rounds * len(KINDS))
    await take_turns(routes, client, turn, rounds, task, warm_up=warm_up)
    task.done()


def layers_table(tallies: dict[tuple[str, str], Tally]) -> Table:
    """``tallies`` by (server, kind), server "without" or "with"."""
    rows: list[Row] = []
    for kind, _ in KINDS:
        without, with_ = tallies[("without", kind)], tallies[("with", kind)]
        rows.append(
            {
                "traffic": kind,
                "req/s without layers": without.rate,
                "req/s with layers": with_.rate,
                "with / without": ratio(with_.rate, without.rate),
                "CPU ms/request without": without.cpu_ms,
                "CPU ms/request with": with_.cpu_ms,
                "spread of burst rates": " / ".join(
                    f"{min(t.rates):.0f}-{max(t.rates):.0f}" for t in (without, with_)
                ),
            }
        )
    return Table(
        f"What --hidden-state-layers {LAYERS} costs all traffic (one request at a time)",
        rows,
        "One server at a time, without and with the layers, twice each in turn. Rates: all "
        "requests over all seconds of that kind of server; CPU: the server's processes (vLLM "
        "and the proxy) per request. The spread is of single bursts' rates (without / with).",
    )
