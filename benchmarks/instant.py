"""The hop alone (issue #15): the proxy's CPU per request in front of an instant upstream, as a
ratio to what a bare uvicorn app (that upstream) spends per request, measured in the same run.
That isolates the hop from vLLM and from the machine's speed.

Several proxies stand side by side in front of the one upstream (``servers.INSTANT_PROXIES``:
the default engine, aiohttp's client, the default over a Unix socket, two workers), so that a
choice between them is made on numbers from one run.

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
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from benchmarks.servers import Server
from vllm_hidden_state_proxy.bench.client import Flag, Request, chat_body, chat_request, new_client
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, ratio, summarize
from vllm_hidden_state_proxy.bench.turns import Tally, burst, burst_turn, take_turns

#: The instant upstream answers any model name.
MODEL = "instant"
#: Requests in flight in the throughput arms.
CONCURRENCY = 16
#: Requests per arm before the measurement (connections, workers).
WARMUP = 3


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
    # A tally's CPU is its target's (a proxy's, or the app's in the direct arms).
    tallies = {arm.name: Tally() for arm in arms}
    app_cpu = dict.fromkeys(tallies, 0.0)

    def chats(client: httpx.AsyncClient, arm: InstantArm) -> Request:
        flag: Flag = "float" if arm.flagged else None
        bodies = (chat_body(MODEL, index, flag=flag, stream=arm.stream) for index in indices)
        return chat_request(client, arm.name, bodies, arm.flagged)

    async def warm_up(client: httpx.AsyncClient, arm: InstantArm) -> None:
        await burst(chats(client, arm), arm.name, WARMUP, 1)

    async def turn(client: httpx.AsyncClient, arm: InstantArm, number: int) -> int:
        count = requests // rounds + (number < requests % rounds)
        app_before = app.cpu()
        await burst_turn(tallies[arm.name], chats(client, arm), arm.name, count, 1, arm.target.cpu)
        app_cpu[arm.name] += app.cpu() - app_before
        return count

    def client(arm: InstantArm) -> httpx.AsyncClient:
        return new_client(arm.target.url, 1)

    task = progress.task(
        "instant upstream (proxy and bare app CPU per request)", requests * len(arms)
    )
    await take_turns(arms, client, turn, rounds, task, warm_up=warm_up)
    task.done()

    def per_request(name: str, proxy: bool) -> float:
        tally = tallies[name]
        return 1e3 * ((tally.cpu or 0.0) if proxy else app_cpu[name]) / tally.requests

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
    tallies = {target.label: Tally() for target in targets}
    indices = itertools.count()
    count = max(concurrency, requests // rounds)

    def chats(client: httpx.AsyncClient, target: Server) -> Request:
        bodies = (chat_body(MODEL, index) for index in indices)
        return chat_request(client, target.label, bodies)

    async def warm_up(client: httpx.AsyncClient, target: Server) -> None:  # connections, workers
        await burst(chats(client, target), target.label, count, concurrency)

    async def turn(client: httpx.AsyncClient, target: Server, _: int) -> int:
        request = chats(client, target)
        return await burst_turn(tallies[target.label], request, target.label, count, concurrency)

    def client(target: Server) -> httpx.AsyncClient:
        return new_client(target.url, concurrency)

    task = progress.task(
        f"instant upstream ({concurrency} in flight)", count * rounds * len(targets)
    )
    await take_turns(targets, client, turn, rounds, task, warm_up=warm_up)
    task.done()
    bare = tallies[app.label]
    rows: list[Row] = [
        {
            "target": "bare app" if target is app else f"proxy ({target.label})",
            "req/s (median of rounds)": statistics.median(tallies[target.label].rates),
            "/ bare app": None
            if target is app
            else median_ratio(tallies[target.label].rates, bare.rates),
        }
        for target in targets
    ]
    return Table(
        f"The hop alone: throughput with {concurrency} in flight",
        rows,
        "Unflagged one-token chats; each target's bursts take turns with the others' in every "
        "round. '/ bare app': the median of the per-round ratios. On 2 cores the load client, "
        "the app and the proxy share them: compare the proxies with one another.",
    )
