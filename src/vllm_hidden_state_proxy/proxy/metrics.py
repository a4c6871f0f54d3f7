"""The proxy's own Prometheus metrics, rendered by hand (text exposition format 0.0.4).

All updates happen on the event loop thread, so plain integers suffice.
"""

from __future__ import annotations

from bisect import bisect_left

PREFIX = "hidden_state_proxy_"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the vector-wait histogram buckets; +Inf is implicit.
WAIT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

KINDS = ("ordinary", "flagged", "embeddings")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: above the largest bound
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound!r}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total!r}")
        lines.append(f"{name}_count {self.count}")
        return lines


MISS_REASONS = ("overwritten", "not_published", "engine_without_ring")


class ProxyMetrics:
    """Counters and the vector-wait histogram for one app instance."""

    def __init__(self) -> None:
        self.requests = dict.fromkeys(KINDS, 0)
        self.flagged_received = 0
        #: 504s by reason: "overwritten" (the ring reused the slot before the response was
        #: complete: raise HIDDEN_STATE_PROXY_RING_SLOTS) or "not_published".
        self.vector_misses = dict.fromkeys(MISS_REASONS, 0)
        self.upstream_errors = 0
        self.vector_wait = Histogram(WAIT_BUCKETS)

    def render(self, *, live_rings: int, engines_without_ring: int) -> bytes:
        requests = f"{PREFIX}requests_total"
        flagged = f"{PREFIX}flagged_requests_total"
        misses = f"{PREFIX}vector_misses_total"
        errors = f"{PREFIX}upstream_errors_total"
        wait = f"{PREFIX}vector_wait_seconds"
        rings = f"{PREFIX}live_rings"
        without = f"{PREFIX}engines_without_ring"
        lines = [
            f"# HELP {requests} Client requests, by kind (embeddings: the proxy's own "
            "/v1/embeddings).",
            f"# TYPE {requests} counter",
            *(f'{requests}{{kind="{kind}"}} {self.requests[kind]}' for kind in KINDS),
            f"# HELP {flagged} Chat requests received with return_last_hidden_state: true "
            "(including ones the proxy refused).",
            f"# TYPE {flagged} counter",
            f"{flagged} {self.flagged_received}",
            f"# HELP {misses} Flagged requests answered 504 without their hidden state, by "
            "reason (overwritten: the ring reused the slot; not_published; engine_without_ring: an "
            "engine of this vLLM has no ring).",
            f"# TYPE {misses} counter",
            *(f'{misses}{{reason="{r}"}} {self.vector_misses[r]}' for r in MISS_REASONS),
            f"# HELP {errors} Failed exchanges with vLLM (connect errors, timeouts, broken "
            "streams).",
            f"# TYPE {errors} counter",
            f"{errors} {self.upstream_errors}",
            f"# HELP {rings} Rings whose worker hook is alive (one per publishing vLLM engine).",
            f"# TYPE {rings} gauge",
            f"{rings} {live_rings}",
            f"# HELP {without} vLLM engines whose worker hook could not start its ring (see the "
            "proxy's log and /health).",
            f"# TYPE {without} gauge",
            f"{without} {engines_without_ring}",
            f"# HELP {wait} Time from vLLM's 200 until the hidden state was found in the ring.",
            f"# TYPE {wait} histogram",
            *self.vector_wait.render(wait),
        ]
        return ("\n".join(lines) + "\n").encode("utf-8")
