"""Embeddings per second through the proxy's own ``POST /v1/embeddings`` at each batch size
(inputs per request: 1, 16, 256 by default), against the same work done by vLLM alone.

- ``proxy``: one ``/v1/embeddings`` request at a time, ``batch`` distinct short texts each,
  float vectors. The proxy fans each request out as ``batch`` flagged one-token chats, at most
  ``--fan-out-limit`` (default 64) in flight, and answers when all are back.
- ``direct``: the very chats the proxy sends for those inputs (its default template, thinking
  off), straight to vLLM, unflagged, at most ``FAN_OUT_LIMIT`` in flight; a "request" is all
  ``batch`` answered.

At each batch size the two arms take turns in rounds (round-robin, rotating start); their
ratio is the median over rounds of their rates in the same round.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from vllm_hidden_state_proxy.bench.client import (
    EMBEDDINGS_PATH,
    BenchError,
    ChatStack,
    Timed,
    embedding_chat_body,
    embedding_inputs_body,
    timed_post,
)
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, summarize
from vllm_hidden_state_proxy.bench.throughput import burst
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

#: The proxy's default ``--fan-out-limit``: the direct arm keeps at most as many chats in flight.
FAN_OUT_LIMIT = ProxySettings.fan_out_limit
#: One per item of an embeddings answer (``"object":"embedding"`` has a comma, not a colon).
EMBEDDING_MARKER = b'"embedding":'
TITLE = "Embeddings: /v1/embeddings through the proxy, one request of N inputs at a time"


def check_embeddings(document: dict[str, Any], batch: int) -> int:
    """The hidden size of a whole answer to ``batch`` inputs: one vector per input, in input
    order, all of one length."""
    data = document.get("data") or []
    sizes = {len(item["embedding"]) for item in data if item.get("embedding")}
    if len(data) != batch or len(sizes) != 1 or [d["index"] for d in data] != list(range(batch)):
        raise BenchError(f"embeddings: {len(data)} vectors of sizes {sizes} for {batch} inputs")
    return sizes.pop()


async def measure_embeddings(
    stack: ChatStack,
    batches: tuple[int, ...],
    rounds: int,
    requests_per_round: Callable[[int], int],
    progress: Progress,
    proxy_cpu: Callable[[], float] | None = None,
    limit: int = FAN_OUT_LIMIT,
) -> Table:
    """At each batch size a warm-up request per arm (the proxy's answer parsed and checked
    whole), then ``rounds`` rounds of ``requests_per_round(batch)`` requests per arm."""
    proxy = stack.client(stack.via_proxy("embeddings", "/v1/embeddings"))
    vllm = stack.client(stack.direct("embeddings direct", "chats"), min(max(batches), limit))
    indices = itertools.count(4_000_000)

    def inputs(batch: int) -> list[int]:
        return [next(indices) for _ in range(batch)]

    async def ask_proxy(batch: int) -> Timed:
        body = embedding_inputs_body(stack.model, inputs(batch))
        return (await timed_post(proxy, EMBEDDINGS_PATH, body)).require_ok("embeddings request")

    async def seconds(via_proxy: bool, batch: int) -> float:
        if via_proxy:  # the vectors counted, not parsed: little work for the client
            timed = await ask_proxy(batch)
            if timed.body.count(EMBEDDING_MARKER) != batch:
                found = timed.body.count(EMBEDDING_MARKER)
                raise BenchError(f"embeddings: {found} vectors for {batch} inputs")
            return timed.seconds
        chats = (embedding_chat_body(stack.model, index) for index in inputs(batch))
        return (await burst(vllm, "embeddings direct", chats, batch, limit))[0]

    rows: list[Row] = []
    total = sum(requests_per_round(b) * b * rounds * 2 for b in batches)
    task = progress.task(f"embeddings (batch sizes {', '.join(map(str, batches))})", total)
    try:
        for batch in batches:  # a warm-up request per arm, the proxy's answer checked whole
            hidden_size = check_embeddings((await ask_proxy(batch)).json(), batch)
            await seconds(False, batch)
            count = requests_per_round(batch)
            latencies: dict[bool, list[float]] = {True: [], False: []}
            rates: dict[bool, list[float]] = {True: [], False: []}
            cpu = 0.0
            for _, via_proxy in round_robin((True, False), rounds):
                cpu_before = proxy_cpu() if proxy_cpu and via_proxy else 0.0
                start = time.perf_counter()
                for _ in range(count):
                    latencies[via_proxy].append(await seconds(via_proxy, batch))
                rates[via_proxy].append(count * batch / (time.perf_counter() - start))
                cpu += proxy_cpu() - cpu_before if proxy_cpu and via_proxy else 0.0
                task.advance(count * batch)
            total_inputs = count * batch * rounds
            proxy_s, vllm_s = summarize(latencies[True], 1e3), summarize(latencies[False], 1e3)
            rows.append(
                {
                    "inputs per request": batch,
                    "inputs/s": total_inputs / sum(latencies[True]),
                    "requests/s": count * rounds / sum(latencies[True]),
                    "p50 ms": proxy_s.p50,
                    "p90 ms": proxy_s.p90,
                    "proxy CPU ms per input": 1e3 * cpu / total_inputs if proxy_cpu else None,
                    "vLLM alone inputs/s": total_inputs / sum(latencies[False]),
                    "vLLM alone p50 ms": vllm_s.p50,
                    "proxy / vLLM alone, inputs/s": median_ratio(rates[True], rates[False]),
                    "requests": count * rounds,
                    "hidden size": hidden_size,
                }
            )
    finally:
        await proxy.aclose()
        await vllm.aclose()
    task.done()
    return Table(
        TITLE,
        rows,
        f"Distinct short texts, float vectors. vLLM alone: the very one-token chats the proxy "
        f"sends for those inputs, unflagged, at most {limit} in flight (the proxy's default "
        "--fan-out-limit); its p50 is the time for all N. The ratio is the median over rounds "
        "of the two arms' rates in the same round.",
    )
