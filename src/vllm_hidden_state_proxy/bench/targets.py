"""The goals of issue #6 as ratios against limits, and further ratios that explain them."""

from __future__ import annotations

from vllm_hidden_state_proxy.bench.embeddings import EMBEDDINGS_DIRECT, EMBEDDINGS_PROXY
from vllm_hidden_state_proxy.bench.latency import (
    DIRECT,
    FLAGGED_BASE64,
    FLAGGED_FLOAT,
    NGINX,
    PASSTHROUGH,
)
from vllm_hidden_state_proxy.bench.pooling import POOLING
from vllm_hidden_state_proxy.bench.results import (
    BenchResults,
    EmbeddingsArm,
    PoolingArm,
    StreamArm,
    TargetCheck,
    ThroughputArm,
    paired_embeddings_ratio,
    paired_ratio,
)
from vllm_hidden_state_proxy.bench.stats import ratio
from vllm_hidden_state_proxy.bench.streaming import STREAM_DIRECT, STREAM_PROXY
from vllm_hidden_state_proxy.bench.throughput import (
    THROUGHPUT_DIRECT,
    THROUGHPUT_FLAGGED,
    THROUGHPUT_PASSTHROUGH,
)

TARGET_CONCURRENCY = 16
TARGET_RING_HIDDEN_SIZE = 4096


def _p50(results: BenchResults, name: str) -> float | None:
    summary = results.latency(name)
    return None if summary is None else summary.p50


def _stream(results: BenchResults, name: str) -> StreamArm | None:
    arm = results.arms.get(name)
    return arm if isinstance(arm, StreamArm) and arm.status == "ok" else None


def _itl_mean(results: BenchResults, name: str) -> float | None:
    arm = _stream(results, name)
    return None if arm is None else arm.itl_mean_ms


def _stream_p50(results: BenchResults, name: str, field: str) -> float | None:
    arm = _stream(results, name)
    summary = None if arm is None else getattr(arm, field)
    return None if summary is None else float(summary.p50)


def _throughput_ratio(results: BenchResults, name: str, concurrency: int) -> float | None:
    """``name``'s rate over the direct arm's, paired round by round (median)."""
    arm = results.arms.get(name)
    direct = results.arms.get(THROUGHPUT_DIRECT)
    if isinstance(arm, ThroughputArm) and isinstance(direct, ThroughputArm):
        return paired_ratio(arm, direct, concurrency)
    return None


def _ring_us(results: BenchResults, hidden_size: int) -> float | None:
    point = next((p for p in results.ring if p.hidden_size == hidden_size), None)
    return None if point is None else point.publish_lookup_p50


def _peak_rss(results: BenchResults) -> float | None:
    """The proxy's peak RSS over the throughput sweep and the embeddings phase."""
    m = results.memory
    peaks = [p for p in (m.proxy_rss_peak_mib, m.proxy_rss_peak_embeddings_mib) if p is not None]
    return max(peaks) if peaks else None


def _embeddings_ratios(results: BenchResults) -> dict[str, float | None]:
    proxy = results.arms.get(EMBEDDINGS_PROXY)
    direct = results.arms.get(EMBEDDINGS_DIRECT)
    if not (isinstance(proxy, EmbeddingsArm) and isinstance(direct, EmbeddingsArm)):
        return {}
    return {
        f"embeddings through the proxy / the same chats to vLLM alone, inputs/s at "
        f"{point.batch_size} inputs per request (median of rounds)": paired_embeddings_ratio(
            proxy, direct, point.batch_size
        )
        for point in proxy.points
    }


def _burst_note(results: BenchResults) -> str:
    """A warning when most streams of an arm came in one burst: their gaps are ~0 and the
    ratio compares two near-zero numbers (time to last token is the number to read then)."""
    for name in (STREAM_DIRECT, STREAM_PROXY):
        arm = _stream(results, name)
        if arm is not None and arm.ttft_ms is not None and 2 * arm.burst_streams > arm.ttft_ms.n:
            return (
                f"{arm.burst_streams} of {arm.ttft_ms.n} {name} streams came in one burst; "
                "read the time-to-last-token ratio instead"
            )
    return ""


def target_checks(results: BenchResults) -> list[TargetCheck]:
    c = TARGET_CONCURRENCY
    return [
        TargetCheck(
            "flagged / direct, latency p50",
            ratio(_p50(results, FLAGGED_FLOAT), _p50(results, DIRECT)),
            "<=",
            1.10,
        ),
        TargetCheck(
            "passthrough / direct, latency p50",
            ratio(_p50(results, PASSTHROUGH), _p50(results, DIRECT)),
            "<=",
            1.08,
        ),
        TargetCheck(
            "flagged / passthrough, latency p50",
            ratio(_p50(results, FLAGGED_FLOAT), _p50(results, PASSTHROUGH)),
            "<=",
            1.02,
        ),
        TargetCheck(
            f"flagged / direct, throughput at concurrency {c} (median of rounds)",
            _throughput_ratio(results, THROUGHPUT_FLAGGED, c),
            ">=",
            0.95,
        ),
        TargetCheck(
            "streaming inter-token latency (mean), proxy / direct",
            ratio(_itl_mean(results, STREAM_PROXY), _itl_mean(results, STREAM_DIRECT)),
            "<=",
            1.02,
            note=_burst_note(results),
        ),
        TargetCheck(
            f"ring publish + lookup p50, {TARGET_RING_HIDDEN_SIZE}-d",
            _ring_us(results, TARGET_RING_HIDDEN_SIZE),
            "<=",
            50.0,
            "µs",
        ),
        TargetCheck(
            "proxy resident memory under load (peak RSS)",
            _peak_rss(results),
            "<=",
            150.0,
            "MiB",
        ),
    ]


def informative_ratios(results: BenchResults) -> dict[str, float | None]:
    """Ratios with no target, for reading the ones with a target."""
    found: dict[str, float | None] = {
        "flagged base64 / direct, latency p50": ratio(
            _p50(results, FLAGGED_BASE64), _p50(results, DIRECT)
        ),
        "nginx / direct, latency p50": ratio(_p50(results, NGINX), _p50(results, DIRECT)),
        "streaming time to first token p50, proxy / direct": ratio(
            _stream_p50(results, STREAM_PROXY, "ttft_ms"),
            _stream_p50(results, STREAM_DIRECT, "ttft_ms"),
        ),
        "streaming time to last token p50, proxy / direct": ratio(
            _stream_p50(results, STREAM_PROXY, "ttlt_ms"),
            _stream_p50(results, STREAM_DIRECT, "ttlt_ms"),
        ),
    }
    levels = sorted(
        {p.concurrency for arm in results.arms_of(ThroughputArm).values() for p in arm.points}
    )
    for level in levels:
        found[f"flagged / direct, throughput at concurrency {level} (median of rounds)"] = (
            _throughput_ratio(results, THROUGHPUT_FLAGGED, level)
        )
        found[f"passthrough / direct, throughput at concurrency {level} (median of rounds)"] = (
            _throughput_ratio(results, THROUGHPUT_PASSTHROUGH, level)
        )
    found.update(_embeddings_ratios(results))
    pooling = results.arms.get(POOLING)
    if isinstance(pooling, PoolingArm) and pooling.latency_ms is not None:
        found["pooling server / flagged, latency p50"] = ratio(
            pooling.latency_ms.p50, _p50(results, FLAGGED_FLOAT)
        )
    return found


def evaluate(results: BenchResults) -> None:
    results.targets = target_checks(results)
    results.ratios = informative_ratios(results)
