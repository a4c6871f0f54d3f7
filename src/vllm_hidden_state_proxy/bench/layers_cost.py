"""What capturing layers costs all traffic (issue #14): two stacks on the tiny model, one
started with ``--hidden-state-layers`` (every layer), one without, side by side. Unflagged and
flagged (final layer, the default request) one-token chats with ``CONCURRENCY`` in flight take
turns burst by burst; the ratio of the two stacks' rates is the median over rounds. The stack
that is not measured is stopped (SIGSTOP) meanwhile: on 2 cores an idle vLLM beside the
measured one moved the rates by tens of percent."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator

from vllm_hidden_state_proxy.bench.client import ChatStack, Flag, Route, chat_body
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.servers import set_running
from vllm_hidden_state_proxy.bench.stats import median_ratio
from vllm_hidden_state_proxy.bench.throughput import burst

CONCURRENCY = 16
#: Every layer of the two-layer tiny model: the most a server can capture.
LAYERS = "0,1,-1"


async def measure_layers_cost(
    plain: ChatStack, layered: ChatStack, requests: int, rounds: int, progress: Progress
) -> Table:
    kinds: tuple[tuple[str, Flag], ...] = (("unflagged", None), ("flagged", "float"))
    # The stacks alternate burst by burst, so that every burst follows the other stack's.
    routes = {
        (stack_name, kind): stack.via_proxy(f"{kind} ({stack_name})", kind, flag)
        for kind, flag in kinds
        for stack_name, stack in (("plain", plain), ("layers", layered))
    }
    stacks = {"plain": plain, "layers": layered}
    indices = itertools.count(3_000_000)

    def bodies(route: Route) -> Iterator[bytes]:
        return (chat_body(plain.model, index, flag=route.flag) for index in indices)

    count = max(CONCURRENCY, requests // rounds)
    clients = {key: stacks[key[0]].client(route, CONCURRENCY) for key, route in routes.items()}
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in routes}
    task = progress.task(f"layers cost ({CONCURRENCY} in flight)", count * rounds * len(routes))

    def measure_only(name: str) -> None:
        set_running(stacks[name], True)
        for other, stack in stacks.items():
            if other != name:
                set_running(stack, False)

    try:
        for key, route in routes.items():  # warm up
            measure_only(key[0])
            await burst(clients[key], route.name, bodies(route), CONCURRENCY, CONCURRENCY)
        for _, key in round_robin(list(routes), rounds):
            route = routes[key]
            measure_only(key[0])
            seconds, _ = await burst(
                clients[key], route.name, bodies(route), count, CONCURRENCY, route.flag is not None
            )
            rates[key].append(count / seconds)
            task.advance(count)
        task.done()
    finally:
        for stack in stacks.values():
            set_running(stack, True)
        for client in clients.values():
            await client.aclose()
    rows: list[Row] = [
        {
            "traffic": kind,
            "req/s without layers": statistics.median(rates[("plain", kind)]),
            "req/s with layers": statistics.median(rates[("layers", kind)]),
            "with / without": median_ratio(rates[("layers", kind)], rates[("plain", kind)]),
        }
        for kind, _ in kinds
    ]
    return Table(
        f"What --hidden-state-layers {LAYERS} costs all traffic ({CONCURRENCY} in flight)",
        rows,
        "Two stacks side by side, one capturing every layer, the other stopped (SIGSTOP) while one "
        "is measured; bursts take turns round by round. "
        "with / without: the median over rounds of the two stacks' rates in the same round.",
    )
