"""The hop alone (issue #15): the proxy's CPU per request in front of an instant upstream, as a
ratio to what a bare uvicorn app (that upstream) spends per request, measured in the same run.
That isolates the hop from vLLM and from the machine's speed.

The arms send one-token chats one at a time, to the bare app directly or through the proxy,
unflagged or flagged, as JSON or as a stream. They take turns in rounds (round-robin, rotating
start), each turn a burst of requests between two readings of both servers' CPU clocks: the
proxy's CPU per request of an arm is all its CPU in that arm's turns over the arm's requests,
and the bare app's per request is the same in the direct arm of the same kind (JSON or stream).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_hidden_state_proxy.bench.client import CHAT_PATH, chat_body, new_client, timed_post
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import ratio, summarize

#: The instant upstream answers any model name.
MODEL = "instant"


@dataclass(frozen=True)
class InstantArm:
    name: str
    description: str
    via_proxy: bool
    flagged: bool = False
    stream: bool = False

    @property
    def baseline(self) -> str:
        return "stream_direct" if self.stream else "direct"


ARMS = (
    InstantArm("direct", "one-token chat straight to the bare app", False),
    InstantArm("passthrough", "the same through the proxy, unflagged", True),
    InstantArm("flagged", "through the proxy, flagged (float vector)", True, True),
    InstantArm("stream_direct", "streamed, straight to the bare app", False, stream=True),
    InstantArm("stream_passthrough", "streamed through the proxy, unflagged", True, stream=True),
    InstantArm("stream_flagged", "streamed through the proxy, flagged", True, True, True),
)


@dataclass
class _Tally:
    requests: int = 0
    proxy_cpu: float = 0.0
    app_cpu: float = 0.0
    latencies: list[float] = field(default_factory=list)


async def measure_instant(
    app_url: str,
    proxy_url: str,
    app_cpu: Callable[[], float],
    proxy_cpu: Callable[[], float],
    requests: int,
    rounds: int,
    progress: Progress,
) -> Table:
    """``requests`` per arm in ``rounds`` turns each (the first turns take one more request
    when ``rounds`` does not divide ``requests``). ``app_cpu`` and ``proxy_cpu`` read each
    server's CPU seconds (the proxy's process tree: all its workers)."""
    indices = itertools.count()
    clients = {arm.name: new_client(proxy_url if arm.via_proxy else app_url, 1) for arm in ARMS}
    tallies = {arm.name: _Tally() for arm in ARMS}

    async def send(arm: InstantArm) -> float:
        body = chat_body(
            MODEL, next(indices), flag="float" if arm.flagged else None, stream=arm.stream
        )
        timed = await timed_post(clients[arm.name], CHAT_PATH, body)
        return timed.require_ok(arm.name, arm.flagged).seconds

    task = progress.task(
        "instant upstream (proxy and bare app CPU per request)", requests * len(ARMS)
    )
    try:
        for arm in ARMS:  # connect and warm up, not recorded
            for _ in range(3):
                await send(arm)
        for number, arm in round_robin(ARMS, rounds):
            count = requests // rounds + (number < requests % rounds)
            tally = tallies[arm.name]
            proxy_before, app_before = proxy_cpu(), app_cpu()
            for _ in range(count):
                tally.latencies.append(await send(arm))
            tally.proxy_cpu += proxy_cpu() - proxy_before
            tally.app_cpu += app_cpu() - app_before
            tally.requests += count
            task.advance(count)
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()

    def per_request(arm: InstantArm, proxy: bool) -> float:
        tally = tallies[arm.name]
        return 1e3 * (tally.proxy_cpu if proxy else tally.app_cpu) / tally.requests

    rows: list[Row] = []
    for arm in ARMS:
        bare = per_request(next(a for a in ARMS if a.name == arm.baseline), proxy=False)
        proxy = per_request(arm, proxy=True) if arm.via_proxy else None
        rows.append(
            {
                "arm": arm.name,
                "what": arm.description,
                "requests": tallies[arm.name].requests,
                "proxy CPU ms/request": proxy,
                "app CPU ms/request": per_request(arm, proxy=False),
                "proxy / app CPU": ratio(proxy, bare),
                "p50 ms": summarize(tallies[arm.name].latencies, 1e3).p50,
            }
        )
    return Table(
        "The hop alone: proxy CPU per request against an instant upstream",
        rows,
        "CPU: user + system time of each server's process tree, read around each turn (Linux "
        "counts it in 10 ms ticks). proxy / app CPU: the proxy's CPU per request of the arm "
        "over the bare app's per request in its direct arm (JSON or stream).",
    )
