"""Streaming arms: ``stream_direct`` (vLLM) and ``stream_proxy`` (through the proxy), unflagged,
``--stream-tokens`` tokens each (``ignore_eos``), interleaved round-robin. Reports time to first
token, inter-token latency (every gap between consecutive token events, pooled per arm, and
their mean) and time to the last token.

On a busy 2-core machine vLLM's API server sometimes gets the tiny model's tokens faster than
it is scheduled to send them, and sends them in one burst at the end: those gaps are ~0 and the
pooled median tells little. The mean inter-token latency and the time to the last token hold
up; the number of burst streams per arm is reported so the reader can judge.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from vllm_hidden_state_proxy.bench.client import StreamTiming, chat_body, new_client, timed_stream
from vllm_hidden_state_proxy.bench.interleave import round_robin
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import StreamArm
from vllm_hidden_state_proxy.bench.stats import summarize

STREAM_DIRECT = "stream_direct"
STREAM_PROXY = "stream_proxy"


@dataclass(frozen=True)
class StreamRoute:
    name: str
    description: str
    base_url: str
    #: The proxy's API key (routes to the proxy only).
    api_key: str | None = field(default=None, repr=False)


def stream_routes(vllm_url: str, proxy_url: str, proxy_key: str | None = None) -> list[StreamRoute]:
    return [
        StreamRoute(STREAM_DIRECT, "streamed chat straight to vLLM, unflagged", vllm_url),
        StreamRoute(STREAM_PROXY, "the same through the proxy", proxy_url, proxy_key),
    ]


async def measure_streaming(
    routes: list[StreamRoute],
    model: str,
    streams: int,
    tokens: int,
    progress: Progress,
    first_index: int = 1_000_000,
) -> list[StreamArm]:
    indices = itertools.count(first_index)
    clients = {route.name: new_client(route.base_url, 1, route.api_key) for route in routes}
    timings: dict[str, list[StreamTiming]] = {route.name: [] for route in routes}
    try:
        for route in routes:  # warm-up, not recorded
            body = chat_body(model, next(indices), max_tokens=tokens, stream=True)
            await timed_stream(clients[route.name], body, tokens)
        task = progress.task(f"streaming ({tokens} tokens a request)", streams * len(routes))
        for _, route in round_robin(routes, streams):
            body = chat_body(model, next(indices), max_tokens=tokens, stream=True)
            timings[route.name].append(await timed_stream(clients[route.name], body, tokens))
            task.advance()
        task.done()
    finally:
        for client in clients.values():
            await client.aclose()
    return [_arm(route, timings[route.name], tokens) for route in routes]


def _arm(route: StreamRoute, timings: list[StreamTiming], tokens: int) -> StreamArm:
    gaps = [gap for timing in timings for gap in timing.gaps]
    return StreamArm(
        route.name,
        route.description,
        ttft_ms=summarize([timing.ttft for timing in timings], 1e3),
        itl_ms=summarize(gaps, 1e3),
        itl_mean_ms=1e3 * math.fsum(gaps) / len(gaps),
        ttlt_ms=summarize([timing.total for timing in timings], 1e3),
        burst_streams=sum(1 for timing in timings if timing.burst),
        tokens_per_request=tokens,
    )
