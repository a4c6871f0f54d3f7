"""The hop alone (issue #15): the proxy's CPU per request in front of an instant upstream, as a
ratio to what a bare uvicorn app (that upstream) spends per request, measured in the same run.
That isolates the hop from vLLM and from the machine's speed.

Several proxies stand side by side in front of the one upstream (``servers.INSTANT_PROXIES``:
the default engine, httpx's own client, two workers), so that a choice between them is made on
numbers from one run.

- **CPU** (table ``instant``): one-token chats one at a time, to the bare app directly or
  through a proxy, unflagged or flagged, as JSON or as a stream (the stream arms go through the
  default proxy only). The arms take turns in rounds (round-robin, rotating start), each turn a
  burst of requests between two readings of both servers' CPU clocks: a proxy's CPU per request
  of an arm is all its CPU in that arm's turns over the arm's requests, and the bare app's per
  request is the same in the direct arm of the same kind (JSON or stream).
- **Throughput** (table ``instant_throughput``): unflagged one-token chats with ``concurrency``
  in flight, straight to the app and through each proxy, burst by burst in rounds; requests per
  second, and each proxy's as a share of the app's (the median of the per-round ratios).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from vllm_hidden_state_proxy.bench.client import CHAT_PATH, chat_body, new_client, timed_post
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.servers import Server
from vllm_hidden_state_proxy.bench.stats import ratio, summarize

#: The instant upstream answers any model name.
MODEL = "instant"
#: Requests in flight in the throughput arms.
CONCURRENCY = 16


@dataclass(frozen=True)
class InstantArm:
    name: str
    target: Server
    flagged: bool = False
    stream: bool = False

    @property
    def via_proxy(self) -> bool:
        return self.target.label != "app"

    @property
    def baseline(self) -> str:
        return "stream_direct" if self.stream else "direct"

    @property
    def description(self) -> str:
        how = "streamed, " if self.stream else "one-token chat, "
        if not self.via_proxy:
            return how + "straight to the bare app"
        return (
            how
            + f"through the {self.target.label} proxy, "
            + ("flagged" if self.flagged else "unflagged")
        )


def cpu_arms(app: Server, proxies: Sequence[Server]) -> list[InstantArm]:
    """direct and stream_direct; per proxy passthrough and flagged (suffixed with its label
    after the first); the stream arms through the first proxy."""
    arms = [InstantArm("direct", app)]
    for number, proxy in enumerate(proxies):
        suffix = "" if number == 0 else f" ({proxy.label})"
        arms.append(InstantArm(f"passthrough{suffix}", proxy))
        arms.append(InstantArm(f"flagged{suffix}", proxy, flagged=True))
    arms.append(InstantArm("stream_direct", app, stream=True))
    arms.append(InstantArm("stream_passthrough", proxies[0], stream=True))
    arms.append(InstantArm("stream_flagged", proxies[0], flagged=True, stream=True))
    return arms


@dataclass
class _Tally:
    requests: int = 0
    proxy_cpu: float = 0.0
    app_cpu: float = 0.0
    latencies: list[float] = field(default_factory=list)


async def measure_instant(
    app: Server,
    proxies: Sequence[Server],
    requests: int,
    rounds: int,
    progress: Progress,
) -> Table:
    """``requests`` per arm in ``rounds`` turns each (the first turns take one more request
    when ``rounds`` does not divide ``requests``). Each target's ``cpu`` reads its CPU seconds
    (a proxy's process tree: all its workers)."""
    arms = cpu_arms(app, proxies)
    indices = itertools.count()
    clients = {arm.name: new_client(arm.target.url, 1) for arm in arms}
    tallies = {arm.name: _Tally() for arm in arms}

    async def send(arm: InstantArm) -> float:
        body = chat_body(
            MODEL, next(indices), flag="float" if arm.flagged else None, stream=arm.stream
        )
        timed = await timed_post(clients[arm.name], CHAT_PATH, body)
        return timed.require_ok(arm.name, arm.flagged).seconds

    task = progress.task(
        "instant upstream (proxy and bare app CPU per request)", requests * len(arms)
    )
    try:
        for arm in arms:  # connect and warm up, not recorded
            for _ in range(3):
                await send(arm)
        for number, arm in round_robin(arms, rounds):
            count = requests // rounds + (number < requests % rounds)
            tally = tallies[arm.name]
            proxy_before, app_before = arm.target.cpu(), app.cpu()
            for _ in range(count):
                tally.latencies.append(await send(arm))
            tally.proxy_cpu += arm.target.cpu() - proxy_before
            tally.app_cpu += app.cpu() - app_before
            tally.requests += count
            task.advance(count)
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()

    def per_request(name: str, proxy: bool) -> float:
        tally = tallies[name]
        return 1e3 * (tally.proxy_cpu if proxy else tally.app_cpu) / tally.requests

    rows: list[Row] = []
    for arm in arms:
        bare = per_request(arm.baseline, proxy=False)
        proxy = per_request(arm.name, proxy=True) if arm.via_proxy else None
        rows.append(
            {
                "arm": arm.name,
                "what": arm.description,
                "requests": tallies[arm.name].requests,
                "proxy CPU ms/request": proxy,
                "app CPU ms/request": per_request(arm.name, proxy=False),
                "proxy / app CPU": ratio(proxy, bare),
                "p50 ms": summarize(tallies[arm.name].latencies, 1e3).p50,
            }
        )
    return Table(
        "The hop alone: proxy CPU per request against an instant upstream",
        rows,
        "CPU: user + system time of each server's process tree, read around each turn (Linux "
        "counts it in 10 ms ticks). proxy / app CPU: the proxy's CPU per request of the arm "
        "over the bare app's per request in its direct arm (JSON or stream). Proxies: "
        + ", ".join(proxy.label for proxy in proxies)
        + " (the first is the default).",
    )


async def measure_instant_throughput(
    app: Server,
    proxies: Sequence[Server],
    requests: int,
    rounds: int,
    progress: Progress,
    concurrency: int = CONCURRENCY,
) -> Table:
    """Requests per second with ``concurrency`` in flight, straight to the app and through
    each proxy, burst by burst (``requests`` per target over ``rounds``)."""
    targets = [app, *proxies]
    clients = {target.label: new_client(target.url, concurrency) for target in targets}
    per_round: dict[str, list[float]] = {target.label: [] for target in targets}
    indices = itertools.count()
    burst = max(concurrency, requests // rounds)

    async def one(target: Server) -> None:
        timed = await timed_post(clients[target.label], CHAT_PATH, chat_body(MODEL, next(indices)))
        timed.require_ok(target.label, False)

    async def run_burst(target: Server) -> float:
        limiter = anyio.CapacityLimiter(concurrency)

        async def limited() -> None:
            async with limiter:
                await one(target)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(burst):
                group.start_soon(limited)
        return burst / (time.perf_counter() - start)

    task = progress.task(
        f"instant upstream ({concurrency} in flight)", burst * rounds * len(targets)
    )
    try:
        for target in targets:
            await run_burst(target)  # warm up: connections, workers
        round_rates: dict[int, dict[str, float]] = {}
        for number, target in round_robin(targets, rounds):
            rate = await run_burst(target)
            per_round[target.label].append(rate)
            round_rates.setdefault(number, {})[target.label] = rate
            task.advance(burst)
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()
    rows: list[Row] = []
    for target in targets:
        shares = [
            rates[target.label] / rates[app.label]
            for rates in round_rates.values()
            if target.label in rates and app.label in rates
        ]
        rows.append(
            {
                "target": "bare app" if target is app else f"proxy ({target.label})",
                "req/s (median of rounds)": statistics.median(per_round[target.label]),
                "/ bare app": statistics.median(shares) if target is not app else None,
            }
        )
    return Table(
        f"The hop alone: throughput with {concurrency} in flight",
        rows,
        "Unflagged one-token chats; each target's bursts take turns with the others' in every "
        "round. '/ bare app': the median of the per-round ratios. On 2 cores the load client, "
        "the app and the proxy share them: compare the proxies with one another.",
    )
