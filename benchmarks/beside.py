"""Ordinary traffic beside flagged requests of each kind (issue #28): what one client asking
for an answer's state, a matrix or spans, request after request, costs everyone else.

Each arm is a kind of flagged request (``none``: no flagged client at all). In its turn, one
client sends 16-token flagged chats of that kind back to back, while :data:`ORDINARY_CONCURRENCY`
clients send a burst of one-token unflagged chats through the proxy; the arm's rate is the
ordinary burst's requests per second. Arms take turns round-robin (rotating start), so a ratio
to ``none`` is the median over rounds of the two rates in the same round.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Route
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, summarize
from vllm_hidden_state_proxy.bench.turns import Tally, burst_turn, take_turns

#: The flagged kinds (``route.pooling`` of the bench's chats; ``"spans"``: mean over spans).
KINDS = ("none", "last", "last_answer", "all_prompt", "all_answer", "spans")
#: Ordinary one-token chats in flight during a turn.
ORDINARY_CONCURRENCY = 4
#: Tokens per flagged chat beside them.
FLAGGED_TOKENS = 16
TITLE = (
    f"Beside flagged traffic: one-token unflagged chats, {ORDINARY_CONCURRENCY} in flight, "
    f"while one client sends {FLAGGED_TOKENS}-token flagged chats of each kind"
)


async def measure_beside(
    stack: ChatStack, rounds: int, burst_size: int, progress: Progress
) -> Table:
    ordinary = stack.via_proxy("ordinary", "one-token chats through the proxy, unflagged")
    flagged = {
        kind: stack.via_proxy(f"flagged_{kind}", f"flagged chats ({kind})", "base64", kind)
        for kind in KINDS[1:]
    }
    indices = itertools.count(7_000_000)
    tallies = {kind: Tally() for kind in KINDS}
    beside: dict[str, int] = dict.fromkeys(KINDS, 0)

    async def keep_sending(client: httpx.AsyncClient, kind: str, route: Route) -> None:
        chat = stack.chat_request(client, route, indices, FLAGGED_TOKENS)
        while True:
            await chat()
            beside[kind] += 1

    async def turn(client: httpx.AsyncClient, kind: str, _: int) -> int:
        chats = stack.chat_request(client, ordinary, indices)
        background: asyncio.Task[None] | None = None
        side = None
        if kind != "none":
            side = stack.client(flagged[kind])
            background = asyncio.create_task(keep_sending(side, kind, flagged[kind]))
        try:
            return await burst_turn(tallies[kind], chats, kind, burst_size, ORDINARY_CONCURRENCY)
        finally:
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
            if side is not None:
                await side.aclose()

    async def warm_up(client: httpx.AsyncClient, kind: str) -> None:
        await stack.chat_request(client, ordinary, indices)()
        if kind != "none":
            async with stack.client(flagged[kind]) as side:
                await stack.chat_request(side, flagged[kind], indices, FLAGGED_TOKENS)()

    def client(kind: str) -> httpx.AsyncClient:
        return stack.client(ordinary, ORDINARY_CONCURRENCY)

    task = progress.task(
        "beside flagged traffic (arms interleaved)", burst_size * rounds * len(KINDS)
    )
    await take_turns(list(KINDS), client, turn, rounds, task, warm_up=warm_up)
    task.done()
    rows: list[Row] = []
    base = tallies["none"]
    for kind in KINDS:
        tally = tallies[kind]
        rows.append(
            {
                "flagged kind beside": kind,
                "ordinary req/s": tally.rate,
                "ordinary / none": median_ratio(tally.rates, base.rates),
                "ordinary p50 ms": summarize(tally.latencies, 1e3).p50,
                "flagged requests beside": beside[kind],
            }
        )
    return Table(
        TITLE,
        rows,
        "Ratios: the median over rounds of the two arms' ordinary rates in the same round. The "
        "flagged client's requests are counted, not timed (the answers phase times them).",
    )
