"""The loop of every phase whose arms take turns; a phase says what its arms are and what one
turn of an arm does (:func:`take_turns`).

Every arm gets one turn per round, and the arm that goes first rotates from round to round
(:func:`round_robin`), so slow drifts of the machine (another process waking up, caches, the
CPU clock) fall on every arm alike instead of on whichever ran last. A turn is one request or
a :func:`burst` of them with a number in flight, added up in the arm's :class:`Tally`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.abc
import httpx

from vllm_hidden_state_proxy.bench.client import BenchError, Request
from vllm_hidden_state_proxy.bench.progress import Task

T = TypeVar("T")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is there (a lighter load client), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def round_robin(arms: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round, arm)`` for ``rounds`` rounds; round ``r`` starts with arm ``r % len(arms)``."""
    for number in range(rounds):
        for offset in range(len(arms)):
            yield number, arms[(number + offset) % len(arms)]


async def take_turns(
    arms: Sequence[T],
    client: Callable[[T], httpx.AsyncClient],
    turn: Callable[[httpx.AsyncClient, T, int], Awaitable[int]],
    rounds: int,
    task: Task,
    *,
    warm_up: Callable[[httpx.AsyncClient, T], Awaitable[object]] | None = None,
    warm_up_rounds: int = 1,
) -> None:
    """A ``client(arm)`` each; ``warm_up_rounds`` rounds of ``warm_up`` (connections, first
    batches: not recorded), then ``rounds`` of ``turn(client, arm, round)``, which returns the
    units of work it did for ``task``. The clients are closed however it ends."""
    clients = [client(arm) for arm in arms]
    order = range(len(arms))
    try:
        if warm_up is not None:
            for _, index in round_robin(order, warm_up_rounds):
                await warm_up(clients[index], arms[index])
        for number, index in round_robin(order, rounds):
            task.advance(await turn(clients[index], arms[index], number))
    finally:
        for opened in clients:
            await opened.aclose()


async def burst(
    request: Request, what: str, count: int, concurrency: int
) -> tuple[float, list[float]]:
    """``count`` requests by ``concurrency`` workers: (wall seconds, per-request seconds). The
    first failure stops the burst."""
    remaining = count
    latencies: list[float] = []
    failures: list[BenchError] = []

    async def worker(group: anyio.abc.TaskGroup) -> None:
        nonlocal remaining
        while remaining > 0 and not failures:
            remaining -= 1
            try:
                latencies.append(await request())
            except BenchError as failure:
                failures.append(failure)
                group.cancel_scope.cancel()

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(min(concurrency, count)):
            group.start_soon(worker, group)
    if failures:
        raise BenchError(f"{what} at concurrency {concurrency}: {failures[0]}")
    return time.perf_counter() - start, latencies


@dataclass
class Tally:
    """One arm's turns, added up: requests, wall seconds, each request's seconds, each turn's
    requests per second, and the CPU seconds of a server read around them (None: not read)."""

    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu: float | None = 0.0

    def add(
        self, requests: int, seconds: float, latencies: Sequence[float], cpu: float | None = None
    ) -> None:
        self.requests += requests
        self.seconds += seconds
        self.latencies.extend(latencies)
        self.rates.append(requests / seconds)
        self.cpu = None if cpu is None or self.cpu is None else self.cpu + cpu

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float | None:
        """CPU milliseconds per request."""
        return None if self.cpu is None else 1e3 * self.cpu / self.requests


async def burst_turn(
    tally: Tally,
    request: Request,
    what: str,
    count: int,
    concurrency: int,
    cpu: Callable[[], float] | None = None,
) -> int:
    """A turn of one :func:`burst`, added to ``tally`` with the CPU seconds that ``cpu`` (a
    server's clock) reads around it; its units of work, ``count``."""
    before = cpu() if cpu else 0.0
    seconds, latencies = await burst(request, what, count, concurrency)
    tally.add(count, seconds, latencies, cpu() - before if cpu else None)
    return count
