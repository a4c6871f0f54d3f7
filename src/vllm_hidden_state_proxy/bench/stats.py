"""Summaries of samples: percentiles by linear interpolation (numpy's default), mean, extremes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``samples``, interpolating linearly between ranks."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(frozen=True)
class Summary:
    """Distribution of one measured quantity, in the unit the caller chose (ms, µs...)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float


def summarize(samples: Sequence[float], scale: float = 1.0) -> Summary:
    """Summary of ``samples``, each multiplied by ``scale`` (e.g. 1e3 for seconds -> ms)."""
    if not samples:
        raise ValueError("summary of no samples")
    scaled = [value * scale for value in samples]
    return Summary(
        n=len(scaled),
        mean=math.fsum(scaled) / len(scaled),
        p50=percentile(scaled, 50),
        p90=percentile(scaled, 90),
        p99=percentile(scaled, 99),
        min=min(scaled),
        max=max(scaled),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None if either is missing or the denominator is not > 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
