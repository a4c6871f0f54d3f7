"""Embeddings per second through the proxy's own ``POST /v1/embeddings``, one request of N
distinct short texts at a time for each N of ``--embedding-batches``, against vLLM alone doing
the same work: the very chats the proxy sends vLLM for those inputs (planned by its own rules),
unflagged, at most the proxy's default ``--fan-out-limit`` in flight; a "request" of that arm
is all N answered. At each N the two arms take turns in rounds."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import orjson

from vllm_hidden_state_proxy.bench.client import (
    BenchError,
    ChatStack,
    Request,
    Timed,
    chat_request,
    timed_post,
)
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import median_ratio, summarize
from vllm_hidden_state_proxy.bench.turns import Tally, burst, burst_turn, take_turns
from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    EmbeddingsDefaults,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

#: The proxy's default ``--fan-out-limit``: the direct arm keeps at most as many chats in flight.
FAN_OUT_LIMIT: int = ProxySettings.fan_out_limit
#: One per item of an embeddings answer (``"object":"embedding"`` has a comma, not a colon).
EMBEDDING_MARKER = b'"embedding":'
TITLE = "Embeddings: /v1/embeddings through the proxy, one request of N inputs at a time"
EMBEDDINGS_PATH = "/v1/embeddings"
#: The proxy's defaults for a text input (its planner turns one into one chat, as below).
PROXY_DEFAULTS = EmbeddingsDefaults(template=DEFAULT_TEMPLATE, max_inputs=1)
#: An arm: through the proxy's ``/v1/embeddings`` (True) or its chats straight to vLLM, at N.
Arm = tuple[bool, int]


def embedding_text(index: int) -> str:
    """Input ``index`` of the embeddings phase: a short text, different for every index."""
    return f"Passage {index}: a yellow bicycle leans on a stone wall in the morning light."


def embedding_inputs_body(model: str, indices: list[int]) -> bytes:
    """A ``/v1/embeddings`` request to the proxy: the texts of ``indices``, float vectors."""
    texts = [embedding_text(index) for index in indices]
    return orjson.dumps({"model": model, "input": texts, "encoding_format": "float"})


def embedding_chat_body(model: str, index: int) -> bytes:
    """The one-token chat the proxy sends vLLM for input ``index``, planned by the proxy's own
    rules (``proxy/endpoints/embeddings_plan.py``), unflagged: what vLLM alone does for that
    input."""
    plan = plan_embeddings({"model": model, "input": embedding_text(index)}, PROXY_DEFAULTS)
    return orjson.dumps(plan.calls[0][1])


def check_embeddings(document: Any, batch: int) -> int:
    """The hidden size of a whole answer to ``batch`` inputs: one vector per input, in input
    order, all of one length."""
    data = (document.get("data") if isinstance(document, dict) else None) or []
    sizes = {len(item["embedding"]) for item in data if item.get("embedding")}
    if len(data) != batch or len(sizes) != 1 or [d["index"] for d in data] != list(range(batch)):
        raise BenchError(f"embeddings: {len(data)} vectors of sizes {sizes} for {batch} inputs")
    return sizes.pop()


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    """At each batch size a warm-up request per arm (the proxy's answer parsed and checked
    whole), then ``options.rounds`` rounds of ``options.embedding_requests(batch)`` requests
    per arm, the proxy's answers checked by counting their vectors (little client work)."""
    batches, rounds, limit = options.embedding_batches, options.rounds, FAN_OUT_LIMIT
    indices = itertools.count(4_000_000)
    tallies = {(via_proxy, batch): Tally() for batch in batches for via_proxy in (True, False)}
    hidden_sizes: dict[int, int] = {}

    def inputs(batch: int) -> list[int]:
        return [next(indices) for _ in range(batch)]

    async def ask_proxy(client: httpx.AsyncClient, batch: int) -> Timed:
        body = embedding_inputs_body(stack.model, inputs(batch))
        return (await timed_post(client, EMBEDDINGS_PATH, body)).require_ok("embeddings request")

    def request(client: httpx.AsyncClient, arm: Arm) -> Request:
        via_proxy, batch = arm

        async def embeddings() -> float:
            timed = await ask_proxy(client, batch)
            if (found := timed.body.count(EMBEDDING_MARKER)) != batch:
                raise BenchError(f"embeddings: {found} vectors for {batch} inputs")
            return timed.seconds

        async def chats() -> float:
            bodies = (embedding_chat_body(stack.model, index) for index in inputs(batch))
            request = chat_request(client, "embeddings direct", bodies)
            return (await burst(request, "embeddings direct", batch, limit))[0]

        return embeddings if via_proxy else chats

    async def warm_up(client: httpx.AsyncClient, arm: Arm) -> None:
        via_proxy, batch = arm
        if via_proxy:
            answer = orjson.loads((await ask_proxy(client, batch)).body)
            hidden_sizes[batch] = check_embeddings(answer, batch)
        else:
            await request(client, arm)()

    async def turn(client: httpx.AsyncClient, arm: Arm, _: int) -> int:
        via_proxy, batch = arm
        clock = stack.proxy_cpu if via_proxy else None
        count = options.embedding_requests(batch)
        what = "embeddings" if via_proxy else "embeddings direct"
        return batch * await burst_turn(tallies[arm], request(client, arm), what, count, 1, clock)

    def client(arm: Arm) -> httpx.AsyncClient:
        via_proxy, batch = arm
        if via_proxy:
            return stack.client(stack.via_proxy("embeddings", "/v1/embeddings"))
        return stack.client(stack.direct("embeddings direct", "chats"), min(batch, limit))

    total = sum(options.embedding_requests(b) * b * rounds * 2 for b in batches)
    task = progress.task(f"embeddings (batch sizes {', '.join(map(str, batches))})", total)
    rows: list[Row] = []
    for batch in batches:
        arms = [(True, batch), (False, batch)]
        await take_turns(arms, client, turn, rounds, task, warm_up=warm_up)
        proxy, vllm = (tallies[arm] for arm in arms)
        proxy_s, vllm_s = summarize(proxy.latencies, 1e3), summarize(vllm.latencies, 1e3)
        rows.append(
            {
                "inputs per request": batch,
                "inputs/s": batch * proxy.requests / sum(proxy.latencies),
                "requests/s": proxy.requests / sum(proxy.latencies),
                "p50 ms": proxy_s.p50,
                "p90 ms": proxy_s.p90,
                "proxy CPU ms per input": proxy.cpu_ms and proxy.cpu_ms / batch,
                "vLLM alone inputs/s": batch * vllm.requests / sum(vllm.latencies),
                "vLLM alone p50 ms": vllm_s.p50,
                "proxy / vLLM alone, inputs/s": median_ratio(proxy.rates, vllm.rates),
                "requests": proxy.requests,
                "hidden size": hidden_sizes[batch],
            }
        )
    task.done()
    return Table(
        TITLE,
        rows,
        f"Distinct short texts, float vectors. vLLM alone: the very one-token chats the proxy "
        f"sends for those inputs, unflagged, at most {limit} in flight (the proxy's default "
        "--fan-out-limit); its p50 is the time for all N. The ratio is the median over rounds "
        "of the two arms' rates in the same round.",
    )
