"""The proxies a run sends to: each one's capture description and how many requests it may
have in flight, and how many all of them may (a vLLM server's rings counted once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.client import Capture


@dataclass
class Proxy:
    """One ``--url``: its capture description (parsed and verbatim), its limit, and the
    requests it has in flight now."""

    url: str
    capture: Capture
    document: dict[str, Any]
    limit: int
    in_flight: int = 0


def proxy_limit(capture: Capture, *, matrix: bool, n: int) -> int:
    """The most requests one proxy may have in flight: no more finished choices than its
    smallest ring has slots, and for matrices no more largest records than its arena holds."""
    slots = min((engine.slots for engine in capture.engines), default=1)
    limit = max(1, slots // n)
    if matrix:
        arena = capture.limits.get("arena_bytes", 0)
        record = max(1, capture.limits.get("max_record_bytes", 1))
        limit = min(limit, max(1, arena // record // n))
    return limit


def most_in_flight(proxies: Sequence[Proxy]) -> int:
    """The proxies' limits summed, each set of rings once: two URLs of one proxy, or two
    proxies of one vLLM server, share its rings' slots (its engines' instance and index)."""
    by_rings: dict[frozenset[tuple[str, int]], int] = {}
    for proxy in proxies:
        rings = frozenset((engine.instance, engine.engine) for engine in proxy.capture.engines)
        by_rings[rings] = min(by_rings.get(rings, proxy.limit), proxy.limit)
    return sum(by_rings.values())
