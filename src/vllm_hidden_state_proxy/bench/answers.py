"""What the answer's state costs (issue #28): chats of ``ANSWER_TOKENS`` tokens, one at a time,
arms interleaved round-robin.

- ``direct``: straight to vLLM, unflagged (the baseline).
- ``flagged_last``: through the proxy, the prompt's last state (published at prefill).
- ``flagged_last_answer``: through the proxy, the answer's state (pooling ``"last_answer"``):
  the hook keeps a copy of each decode step's row and publishes the latest few when the answer
  finishes; the proxy asks vLLM for the token ids, waits for the record after vLLM's answer,
  and takes the ids out again.

The ratio ``last_answer / last`` is what the answer's state adds to a flagged request.
"""

from __future__ import annotations

import itertools

import httpx

from vllm_hidden_state_proxy.bench.client import ChatStack, Route
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table, summary_cells
from vllm_hidden_state_proxy.bench.stats import ratio, summarize
from vllm_hidden_state_proxy.bench.turns import take_turns

#: Tokens per answer (``ignore_eos``: exactly that many).
ANSWER_TOKENS = 16
TITLE = f"Answers: {ANSWER_TOKENS}-token chats, one request at a time, arms interleaved"


def routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", f"{ANSWER_TOKENS}-token chat straight to vLLM, unflagged"),
        stack.via_proxy("flagged_last", "through the proxy: the prompt's last state", "base64"),
        stack.via_proxy(
            "flagged_last_answer",
            "through the proxy: the answer's state (last_answer)",
            "base64",
            "last_answer",
        ),
    ]


async def measure_answers(
    stack: ChatStack, requests: int, warmup: int, progress: Progress
) -> Table:
    arms = routes(stack)
    indices = itertools.count(5_000_000)
    samples: dict[str, list[float]] = {route.name: [] for route in arms}

    async def warm_up(client: httpx.AsyncClient, route: Route) -> None:
        await stack.chat_request(client, route, indices, ANSWER_TOKENS)()

    async def turn(client: httpx.AsyncClient, route: Route, _: int) -> int:
        chat = stack.chat_request(client, route, indices, ANSWER_TOKENS)
        samples[route.name].append(await chat())
        return 1

    task = progress.task("answers (one request at a time, arms interleaved)", requests * len(arms))
    await take_turns(
        arms, stack.client, turn, requests, task, warm_up=warm_up, warm_up_rounds=warmup
    )
    task.done()
    summaries = {name: summarize(values, 1e3) for name, values in samples.items()}
    rows: list[Row] = []
    for route in arms:
        p50 = summaries[route.name].p50
        row: Row = {
            "arm": route.name,
            "what": route.description,
            **summary_cells(summaries[route.name]),
        }
        row["p50 / direct"] = ratio(p50, summaries["direct"].p50)
        if route.pooling == "last_answer":
            row["p50 / flagged_last"] = ratio(p50, summaries["flagged_last"].p50)
        rows.append(row)
    return Table(TITLE, rows)
