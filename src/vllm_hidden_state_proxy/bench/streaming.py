"""Streaming arms: ``stream_direct`` (vLLM) and ``stream_proxy`` (through the proxy), unflagged,
``--stream-tokens`` tokens each, interleaved round-robin: time to first token, inter-token
latency (every gap between token events, pooled per arm) and time to the last token. On a busy
machine vLLM's API server sometimes sends a stream's tokens in one burst (gaps of ~0): the
table counts such streams per arm, so the reader can judge.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import httpx
import orjson

from vllm_hidden_state_proxy.bench.client import (
    BenchError,
    ChatStack,
    Route,
    chat_body,
    transport_error,
)
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import ratio, summarize
from vllm_hidden_state_proxy.bench.turns import take_turns
from vllm_hidden_state_proxy.protocol import CHAT_PATH

#: Two token events closer than this came in one burst (one read), not one by one.
BURST_GAP = 1e-4


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: seconds to the first token, between tokens, to the last token."""

    ttft: float
    gaps: list[float]
    total: float

    @property
    def burst(self) -> bool:
        """The tokens came (nearly) all at once: at least 90% of the gaps under ``BURST_GAP``."""
        return sum(1 for gap in self.gaps if gap < BURST_GAP) >= 0.9 * len(self.gaps)


def tokens_in_event(data: bytes) -> int:
    """How many generated tokens an SSE event carries: its first choice's ``token_ids`` (vLLM
    merges tokens into one event when its consumer falls behind), else 1 for a content delta.
    The opening ``role`` announcement and the closing usage event (no choices) carry none."""
    chunk = orjson.loads(data)
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return 0
    token_ids = choices[0].get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    return 0 if "role" in (choices[0].get("delta") or {}) else 1


async def timed_stream(client: httpx.AsyncClient, body: bytes, expected: int) -> StreamTiming:
    """Stream a chat request and time each token event as it arrives."""
    arrivals: list[float] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", CHAT_PATH, content=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:500].decode(errors="replace")
                raise BenchError(f"streaming request: HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if line.startswith("data: ") and line != "data: [DONE]":
                    # Tokens that came in one event came at once: each gets its arrival.
                    arrivals.extend([now] * tokens_in_event(line[6:].encode()))
    except httpx.TransportError as error:
        raise transport_error(f"streaming from {client.base_url}", error) from None
    if len(arrivals) != expected:
        raise BenchError(f"streaming request: {len(arrivals)} tokens, expected {expected}")
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return StreamTiming(arrivals[0] - start, gaps, arrivals[-1] - start)


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    streams, tokens = options.streams, options.stream_tokens
    routes = [
        stack.direct("stream_direct", "streamed chat straight to vLLM, unflagged"),
        stack.via_proxy("stream_proxy", "the same through the proxy"),
    ]
    indices = itertools.count(1_000_000)
    timings: dict[str, list[StreamTiming]] = {route.name: [] for route in routes}

    async def stream(client: httpx.AsyncClient, _: Route) -> StreamTiming:
        body = chat_body(stack.model, next(indices), max_tokens=tokens, stream=True)
        return await timed_stream(client, body, tokens)

    async def turn(client: httpx.AsyncClient, route: Route, _: int) -> int:
        timings[route.name].append(await stream(client, route))
        return 1

    task = progress.task(f"streaming ({tokens} tokens a request)", streams * len(routes))
    await take_turns(routes, stack.client, turn, streams, task, warm_up=stream)
    task.done()
    found = {route.name: _numbers(timings[route.name]) for route in routes}
    rows: list[Row] = []
    for route in routes:
        row: Row = {"arm": route.name, **found[route.name]}
        if route.name == "stream_proxy":
            for column in ("ITL mean", "TTFT p50", "last token p50"):
                mine, direct = found[route.name], found["stream_direct"]
                row[f"{column} / direct"] = ratio(mine[f"{column} ms"], direct[f"{column} ms"])
        rows.append(row)
    return Table(
        f"Streaming: {tokens} tokens a request (unflagged), arms interleaved",
        rows,
        "Burst streams: tokens that arrived all at once (vLLM's API server sent them back to "
        "back), so their gaps are ~0; read time to last token then. See docs/benchmark.md.",
    )


def _numbers(timings: list[StreamTiming]) -> dict[str, float]:
    gaps = summarize([gap for timing in timings for gap in timing.gaps], 1e3)
    last = summarize([timing.total for timing in timings], 1e3)
    return {
        "TTFT p50 ms": statistics.median(1e3 * timing.ttft for timing in timings),
        "ITL mean ms": gaps.mean,
        "ITL p50 ms": gaps.p50,
        "ITL p99 ms": gaps.p99,
        "last token p50 ms": last.p50,
        "last token p90 ms": last.p90,
        "burst streams": sum(1 for timing in timings if timing.burst),
        "n": len(timings),
        "gaps": gaps.n,
    }
