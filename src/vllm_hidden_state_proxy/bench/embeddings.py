"""Embeddings arms: inputs per second through the proxy's own ``POST /v1/embeddings`` at each
batch size (inputs per request: 1, 16, 256 by default), and the same work done by vLLM alone.

- ``embeddings_proxy``: one ``/v1/embeddings`` request at a time, ``batch`` distinct short
  texts each, float vectors. The proxy fans each request out as ``batch`` flagged one-token
  chats, at most ``--fan-out-limit`` (default 64) in flight, and answers when all are back.
- ``embeddings_direct``: the baseline, the very chats the proxy sends for those inputs (the
  proxy's default template, thinking disabled) straight to vLLM, unflagged, ``batch`` at a
  time with at most ``FAN_OUT_LIMIT`` in flight; one "request" is all ``batch`` answered.

Every input is a text of its own. As in the throughput sweep the two arms take turns in rounds
at each batch size (round-robin, rotating start), and each arm's rate in each round is kept:
the median of the paired per-round ratios compares them under the same conditions. A proxy
without ``/v1/embeddings`` (an older one, in target mode) marks the phase unsupported.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import httpx

from vllm_hidden_state_proxy.bench.client import (
    CHAT_PATH,
    EMBEDDINGS_PATH,
    BenchError,
    Timed,
    embedding_chat_body,
    embedding_inputs_body,
    new_client,
    timed_post,
)
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import EmbeddingsArm, EmbeddingsPoint
from vllm_hidden_state_proxy.bench.stats import summarize

EMBEDDINGS_PROXY = "embeddings_proxy"
EMBEDDINGS_DIRECT = "embeddings_direct"
#: The proxy's default ``--fan-out-limit``: the direct arm keeps at most as many chats in flight.
FAN_OUT_LIMIT = 64
#: One per item of an embeddings answer (``"object":"embedding"`` has a comma, not a colon).
EMBEDDING_MARKER = b'"embedding":'


@dataclass(frozen=True)
class EmbeddingsRoute:
    name: str
    description: str
    base_url: str
    #: True: ``/v1/embeddings`` requests to the proxy; False: the equivalent chats to vLLM.
    via_proxy: bool
    #: The proxy's API key (routes to the proxy only).
    api_key: str | None = field(default=None, repr=False)


def embeddings_routes(
    vllm_url: str, proxy_url: str, proxy_key: str | None = None
) -> list[EmbeddingsRoute]:
    return [
        EmbeddingsRoute(
            EMBEDDINGS_PROXY,
            "/v1/embeddings through the proxy, one request of N inputs at a time",
            proxy_url,
            True,
            proxy_key,
        ),
        EmbeddingsRoute(
            EMBEDDINGS_DIRECT,
            f"the same N one-token chats straight to vLLM, unflagged, at most "
            f"{FAN_OUT_LIMIT} in flight",
            vllm_url,
            False,
        ),
    ]


def check_embeddings(document: dict[str, Any], batch: int) -> int:
    """The hidden size of a whole embeddings answer to ``batch`` inputs: ``data`` lists one
    non-empty float vector per input, in input order, all of one length."""
    data = document.get("data")
    if not isinstance(data, list):
        raise BenchError(f"embeddings: no 'data' list in the answer: {str(document)[:300]}")
    if len(data) != batch:
        raise BenchError(f"embeddings: {len(data)} items in 'data' for {batch} inputs")
    sizes = set()
    for position, item in enumerate(data):
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(vector, list) or not vector:
            raise BenchError(f"embeddings: item {position} has no float vector")
        if not all(isinstance(x, (int, float)) for x in vector):
            raise BenchError(f"embeddings: item {position} holds something other than numbers")
        if item.get("index") != position:
            raise BenchError(f"embeddings: item {position} has index {item.get('index')!r}")
        sizes.add(len(vector))
    if len(sizes) != 1:
        raise BenchError(f"embeddings: vectors of different lengths {sorted(sizes)}")
    return sizes.pop()


def embeddings_in(body: bytes) -> int:
    """How many vectors an answer holds, by a byte search (no parse, so the client's work
    stays small next to the servers')."""
    return body.count(EMBEDDING_MARKER)


def probe_problem(status: int, body: bytes) -> str | None:
    """Why the proxy's first ``/v1/embeddings`` answer marks the phase unsupported (a 4xx: an
    older proxy forwards the path to vLLM, which does not embed with a generate model); None
    for a 200. A refused key and a server error stop the run instead."""
    if status == 200:
        return None
    text = body[:300].decode(errors="replace")
    if status in (401, 403):
        raise BenchError(f"embeddings: HTTP {status} from the proxy (check --api-key): {text}")
    if 400 <= status < 500 and status != 429:
        return f"the proxy answered {status}: {text}"
    raise BenchError(f"embeddings: HTTP {status}: {text}")


async def fan_out(
    client: httpx.AsyncClient, bodies: Sequence[bytes], limit: int, what: str
) -> None:
    """Send every chat body, at most ``limit`` in flight; the first failure stops the rest."""
    pending: Iterable[bytes] = iter(bodies)
    failures: list[BenchError] = []

    async def worker(group: anyio.abc.TaskGroup) -> None:
        for body in pending:  # one shared iterator: each body goes to exactly one worker
            if failures:
                return
            try:
                (await timed_post(client, CHAT_PATH, body)).require_ok(what)
            except BenchError as failure:
                failures.append(failure)
                group.cancel_scope.cancel()
                return

    async with anyio.create_task_group() as group:
        for _ in range(min(limit, len(bodies))):
            group.start_soon(worker, group)
    if failures:
        raise failures[0]


@dataclass
class _Tally:
    requests: int = 0
    inputs: int = 0
    seconds: float = 0.0
    cpu_seconds: float | None = None
    latencies: list[float] = field(default_factory=list)
    rounds_ips: list[float] = field(default_factory=list)

    def point(self, batch: int) -> EmbeddingsPoint:
        return EmbeddingsPoint(
            batch_size=batch,
            requests=self.requests,
            inputs=self.inputs,
            seconds=self.seconds,
            inputs_per_second=self.inputs / self.seconds,
            requests_per_second=self.requests / self.seconds,
            latency_ms=summarize(self.latencies, 1e3),
            rounds_ips=self.rounds_ips,
            proxy_cpu_ms_per_input=(
                None if self.cpu_seconds is None else 1e3 * self.cpu_seconds / self.inputs
            ),
        )


class _Run:
    def __init__(self, model: str, first_index: int, limit: int) -> None:
        self.model = model
        self.limit = limit
        self._next = itertools.count(first_index)

    def indices(self, batch: int) -> int:
        """The first of ``batch`` fresh input indices (no text is sent twice)."""
        first = next(self._next)
        for _ in range(batch - 1):
            next(self._next)
        return first

    async def once(self, route: EmbeddingsRoute, client: httpx.AsyncClient, batch: int) -> float:
        """One request of ``batch`` inputs (checked by a byte count); its seconds."""
        first = self.indices(batch)
        if route.via_proxy:
            body = embedding_inputs_body(self.model, first, batch)
            timed = await timed_post(client, EMBEDDINGS_PATH, body)
            timed.require_ok(f"{route.name} request of {batch} inputs")
            if embeddings_in(timed.body) != batch:
                raise BenchError(
                    f"{route.name}: {embeddings_in(timed.body)} vectors for {batch} inputs"
                )
            return timed.seconds
        bodies = [embedding_chat_body(self.model, first + offset) for offset in range(batch)]
        start = time.perf_counter()
        await fan_out(client, bodies, self.limit, f"{route.name} chat")
        return time.perf_counter() - start

    async def unchecked(self, client: httpx.AsyncClient, batch: int) -> Timed:
        """One proxy request of ``batch`` inputs, its answer as it came."""
        body = embedding_inputs_body(self.model, self.indices(batch), batch)
        return await timed_post(client, EMBEDDINGS_PATH, body)


async def measure_embeddings(
    routes: list[EmbeddingsRoute],
    model: str,
    batches: tuple[int, ...],
    rounds: int,
    requests_per_round: Callable[[int], int],
    progress: Progress,
    proxy_cpu_seconds: Callable[[], float] | None = None,
    first_index: int = 4_000_000,
    limit: int = FAN_OUT_LIMIT,
) -> list[EmbeddingsArm]:
    """Every batch size in turn; at each, a warm-up request per arm (the proxy's parsed and
    checked whole), then ``rounds`` rounds of ``requests_per_round(batch)`` requests per arm."""
    run = _Run(model, first_index, limit)
    arms = {route.name: EmbeddingsArm(route.name, route.description) for route in routes}
    widest = min(max(batches), limit)
    clients = {
        route.name: new_client(route.base_url, 1 if route.via_proxy else widest, route.api_key)
        for route in routes
    }
    try:
        problem = await _probe(run, routes, clients, arms)
        if problem is not None:
            progress.say(f"embeddings: unsupported ({problem})")
            return _not_measured(routes, arms, problem)
        total = sum(requests_per_round(b) * b * rounds * len(routes) for b in batches)
        task = progress.task(
            f"embeddings (batch sizes {', '.join(map(str, batches))}; inputs)", total
        )
        for batch in batches:
            tallies = {route.name: _Tally() for route in routes}
            for route in routes:  # warm-up (connections, the proxy's pool), not recorded
                client = clients[route.name]
                if route.via_proxy:
                    await _check_whole(run, client, batch, arms[route.name])
                else:
                    await run.once(route, client, batch)
            for _, route in round_robin(routes, rounds):
                count = requests_per_round(batch)
                tally = tallies[route.name]
                cpu = proxy_cpu_seconds if route.via_proxy else None
                cpu_before = cpu() if cpu is not None else 0.0
                start = time.perf_counter()
                for _ in range(count):
                    tally.latencies.append(await run.once(route, clients[route.name], batch))
                seconds = time.perf_counter() - start
                if cpu is not None:
                    tally.cpu_seconds = (tally.cpu_seconds or 0.0) + cpu() - cpu_before
                tally.requests += count
                tally.inputs += count * batch
                tally.seconds += seconds
                tally.rounds_ips.append(count * batch / seconds)
                task.advance(count * batch)
            for route in routes:
                arms[route.name].points.append(tallies[route.name].point(batch))
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()
    return [arms[route.name] for route in routes]


async def _check_whole(
    run: _Run, client: httpx.AsyncClient, batch: int, arm: EmbeddingsArm
) -> None:
    """One request of ``batch`` inputs, its answer parsed and checked whole."""
    timed = (await run.unchecked(client, batch)).require_ok(f"{arm.name} warm-up")
    size = check_embeddings(timed.json(), batch)
    if arm.hidden_size is not None and size != arm.hidden_size:
        raise BenchError(f"{arm.name}: vectors of {size} values, expected {arm.hidden_size}")
    arm.hidden_size = size


async def _probe(
    run: _Run,
    routes: list[EmbeddingsRoute],
    clients: dict[str, httpx.AsyncClient],
    arms: dict[str, EmbeddingsArm],
) -> str | None:
    """One single-input request to the proxy: None if it embeds, else why not."""
    for route in routes:
        if route.via_proxy:
            timed = await run.unchecked(clients[route.name], 1)
            problem = probe_problem(timed.status, timed.body)
            if problem is not None:
                return problem
            arms[route.name].hidden_size = check_embeddings(timed.json(), 1)
    return None


def _not_measured(
    routes: list[EmbeddingsRoute], arms: dict[str, EmbeddingsArm], problem: str
) -> list[EmbeddingsArm]:
    for route in routes:
        arm = arms[route.name]
        if route.via_proxy:
            arm.status, arm.note = "unsupported", problem
        else:
            arm.status, arm.note = "skipped", "the proxy does not serve /v1/embeddings"
    return [arms[route.name] for route in routes]


def skipped_arms(reason: str) -> list[EmbeddingsArm]:
    """Both arms, not run (``--no-embeddings``)."""
    return [
        EmbeddingsArm(route.name, route.description, status="skipped", note=reason)
        for route in embeddings_routes("", "")
    ]
