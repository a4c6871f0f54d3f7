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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from vllm_hidden_state_proxy.bench.client import ChatStack, Flag, chat_body
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import ratio
from vllm_hidden_state_proxy.bench.throughput import burst

CONCURRENCY = 1
#: Requests per kind before a visit's measurement (connections, first batches).
WARMUP = 16
#: Every layer of the two-layer tiny model: the most a server can capture.
LAYERS = "0,1,-1"
#: The servers, in the order they run.
VISITS = ("without", "with", "without", "with")
KINDS: tuple[tuple[str, Flag], ...] = (("unflagged", None), ("flagged", "float"))


@dataclass
class Tally:
    """One kind of traffic on one kind of server, over all its visits."""

    requests: int = 0
    seconds: float = 0.0
    cpu: float | None = 0.0
    rates: list[float] = field(default_factory=list)

    def add(self, requests: int, seconds: float, cpu: float | None) -> None:
        self.requests += requests
        self.seconds += seconds
        self.cpu = None if cpu is None or self.cpu is None else self.cpu + cpu
        self.rates.append(requests / seconds)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float | None:
        return None if self.cpu is None else 1e3 * self.cpu / self.requests


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
    routes = {kind: stack.via_proxy(kind, kind, flag) for kind, flag in KINDS}
    clients = {kind: stack.client(route, CONCURRENCY) for kind, route in routes.items()}

    def bodies(flag: Flag) -> Iterator[bytes]:
        return (chat_body(stack.model, index, flag=flag) for index in indices)

    task = progress.task("layers cost (one request at a time)", count * rounds * len(KINDS))
    try:
        for kind, flag in KINDS:  # warm up
            await burst(clients[kind], kind, bodies(flag), WARMUP, CONCURRENCY)
        for _, (kind, flag) in round_robin(KINDS, rounds):
            before = cpu() if cpu else None
            seconds, _ = await burst(
                clients[kind], kind, bodies(flag), count, CONCURRENCY, flag is not None
            )
            spent = None if before is None or cpu is None else cpu() - before
            tallies[kind].add(count, seconds, spent)
            task.advance(count)
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()


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
