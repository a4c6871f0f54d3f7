"""Latency arms: one-token chat requests, one at a time, interleaved round-robin.

- ``direct``: straight to vLLM, unflagged (the baseline).
- ``passthrough``: the same request through the proxy, unflagged.
- ``flagged_float``: through the proxy with ``return_last_hidden_state`` (JSON float list).
- ``flagged_base64``: the same with ``last_hidden_state_format: "base64"``; a server that
  answers 400 (or ignores the format) marks the arm unsupported.
- ``nginx``: straight to vLLM through nginx (only when nginx runs): one hop in C, the anchor.

Every request has its own prompt (a common prefix, a different request number), so no arm
profits from another's prefix-cache entry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import httpx

from vllm_hidden_state_proxy.bench.client import (
    CHAT_PATH,
    BenchError,
    Flag,
    chat_body,
    decode_base64_vector,
    new_client,
    returned_vector,
    timed_post,
)
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import LatencyArm
from vllm_hidden_state_proxy.bench.stats import summarize

DIRECT = "direct"
PASSTHROUGH = "passthrough"
FLAGGED_FLOAT = "flagged_float"
FLAGGED_BASE64 = "flagged_base64"
NGINX = "nginx"


@dataclass(frozen=True)
class Route:
    """Where an arm sends its requests, and with which flag."""

    name: str
    description: str
    base_url: str
    flag: Flag = None
    #: The proxy's API key (routes to the proxy only).
    api_key: str | None = field(default=None, repr=False)


def routes(
    vllm_url: str, proxy_url: str, nginx_url: str | None, proxy_key: str | None = None
) -> list[Route]:
    found = [
        Route(DIRECT, "one-token chat straight to vLLM, unflagged", vllm_url),
        Route(PASSTHROUGH, "the same through the proxy, unflagged", proxy_url, api_key=proxy_key),
        Route(
            FLAGGED_FLOAT,
            "through the proxy, flagged: vector as a JSON float list",
            proxy_url,
            "float",
            proxy_key,
        ),
        Route(
            FLAGGED_BASE64,
            "through the proxy, flagged: vector as base64 float32",
            proxy_url,
            "base64",
            proxy_key,
        ),
    ]
    if nginx_url is not None:
        found.append(
            Route(NGINX, "straight to vLLM through nginx (reverse-proxy anchor)", nginx_url)
        )
    return found


@dataclass
class LatencyOutcome:
    arms: list[LatencyArm]
    #: Prompt index -> the vector the proxy returned for it (float arm), for the pooling phase.
    vectors: dict[int, list[float]] = field(default_factory=dict)
    #: Prompt index -> prompt tokens vLLM reported for it.
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    hidden_size: int | None = None


class _Run:
    def __init__(self, model: str, keep_vectors: int) -> None:
        self.model = model
        self.keep_vectors = keep_vectors
        self.indices = itertools.count()
        self.outcome = LatencyOutcome(arms=[])

    async def once(self, route: Route, client: httpx.AsyncClient) -> float:
        """Send one request; check its answer; return its latency in seconds."""
        index = next(self.indices)
        timed = await timed_post(client, CHAT_PATH, chat_body(self.model, index, flag=route.flag))
        timed.require_ok(f"{route.name} request")
        if route.flag is not None:
            self._check_vector(route, index, timed.json())
        return timed.seconds

    def _check_vector(self, route: Route, index: int, completion: dict[str, object]) -> None:
        vector = returned_vector(completion)
        if vector is None:
            raise BenchError(f"{route.name}: the response has no kv_transfer_params vector")
        floats = decode_base64_vector(vector) if isinstance(vector, str) else vector
        if self.outcome.hidden_size is None:
            self.outcome.hidden_size = len(floats)
        if len(floats) != self.outcome.hidden_size or not floats:
            raise BenchError(
                f"{route.name}: a vector of {len(floats)} values, expected "
                f"{self.outcome.hidden_size}"
            )
        if route.flag == "float" and len(self.outcome.vectors) < self.keep_vectors:
            self.outcome.vectors[index] = floats
            usage = completion.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                self.outcome.prompt_tokens[index] = usage["prompt_tokens"]

    async def probe_base64(self, route: Route, client: httpx.AsyncClient) -> str | None:
        """None if the server returns base64 vectors; else why the arm is unsupported."""
        index = next(self.indices)
        timed = await timed_post(client, CHAT_PATH, chat_body(self.model, index, flag="base64"))
        if timed.status == 400:
            return f"the server answered 400: {timed.body[:300].decode(errors='replace')}"
        timed.require_ok(f"{route.name} request")
        if not isinstance(returned_vector(timed.json()), str):
            return "the server ignored last_hidden_state_format and returned a float list"
        self._check_vector(route, index, timed.json())
        return None


async def measure_latency(
    all_routes: list[Route],
    model: str,
    requests: int,
    warmup: int,
    progress: Progress,
    keep_vectors: int = 32,
) -> LatencyOutcome:
    run = _Run(model, keep_vectors)
    clients = {route.name: new_client(route.base_url, 1, route.api_key) for route in all_routes}
    try:
        active: list[Route] = []
        for route in all_routes:
            reason = None
            if route.flag == "base64":
                reason = await run.probe_base64(route, clients[route.name])
            if reason is None:
                active.append(route)
            else:
                progress.say(f"{route.name}: unsupported ({reason})")
                run.outcome.arms.append(
                    LatencyArm(route.name, route.description, "unsupported", reason)
                )
        for _, route in round_robin(active, warmup):
            await run.once(route, clients[route.name])
        samples: dict[str, list[float]] = {route.name: [] for route in active}
        task = progress.task(
            "latency (one request at a time, arms interleaved)", requests * len(active)
        )
        for _, route in round_robin(active, requests):
            samples[route.name].append(await run.once(route, clients[route.name]))
            task.advance()
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()
    for route in active:
        run.outcome.arms.append(
            LatencyArm(
                route.name, route.description, latency_ms=summarize(samples[route.name], 1e3)
            )
        )
    order = [route.name for route in all_routes]
    run.outcome.arms.sort(key=lambda arm: order.index(arm.name))
    return run.outcome
