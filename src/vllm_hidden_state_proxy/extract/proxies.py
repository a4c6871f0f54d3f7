"""The proxies a run sends to: each one's capture description and how many requests it may
have in flight (its rings' slots, its front server's connections), and how many all of them may
(a vLLM server's rings counted once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.client import Capture


@dataclass
class Proxy:
    """One ``--url``: its capture description (parsed and verbatim), the most inputs it may
    have in flight and how many it has by default, the inputs it has in flight now, and whether
    it serves ``/v1/chat/completions/batch`` (``None``: not known yet)."""

    url: str
    capture: Capture
    document: dict[str, Any]
    limit: int
    default: int
    in_flight: int = 0
    chat_batches: bool | None = None


def proxy_limits(capture: Capture, *, matrix: bool, n: int) -> tuple[int, int]:
    """The most requests one proxy may have in flight, and its default: no more finished
    choices than its smallest ring has slots, for matrices no more largest records than its
    arena holds, and, when the capture description says how many connections its front server
    takes (``--max-client-connections``), fewer than that and by default half of it.

    uvicorn answers a plain-text 503 to a request that finds that many connections open (its
    own included) or that many requests still running, and a request runs until its task ends,
    after its answer was sent: at a high rate the front server counts more requests than the
    client has in flight (measured against a fast fake vLLM: 56 in flight, 93 counted; 48 of 64
    took 60 such 503s over 3,000 inputs, 32 none). Half of 1024 is still more than the batch of
    vLLM's default ``--max-num-seqs`` but on GPUs of 70 GiB or more."""
    slots = min((engine.slots for engine in capture.engines), default=1)
    limit = max(1, slots // n)
    if matrix:
        arena = capture.limits.get("arena_bytes", 0)
        record = max(1, capture.limits.get("max_record_bytes", 1))
        limit = min(limit, max(1, arena // record // n))
    connections = capture.limits.get("max_client_connections")
    if connections is None:  # a proxy of an earlier release: its rings alone
        return limit, limit
    limit = min(limit, max(1, connections - 1))
    return limit, min(limit, max(1, connections // 2))


def most_in_flight(proxies: Sequence[Proxy], *, default: bool = False) -> int:
    """The proxies' limits (or defaults) summed, each set of rings once: two URLs of one proxy,
    or two proxies of one vLLM server, share its rings' slots (its engines' instance and
    index)."""
    by_rings: dict[frozenset[tuple[str, int]], int] = {}
    for proxy in proxies:
        value = proxy.default if default else proxy.limit
        rings = frozenset((engine.instance, engine.engine) for engine in proxy.capture.engines)
        by_rings[rings] = min(by_rings.get(rings, value), value)
    return sum(by_rings.values())


def proxy_limit(capture: Capture, *, matrix: bool, n: int) -> int:
    """What a run has in flight at this one proxy without ``--concurrency`` (its default)."""
    return proxy_limits(capture, matrix=matrix, n=n)[1]
