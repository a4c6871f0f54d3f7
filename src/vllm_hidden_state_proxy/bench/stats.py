"""Summaries of samples (the standard library's ``statistics``) and ratios between arms."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """One measured quantity, in the unit the caller chose (ms, µs...)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float


def summarize(samples: Sequence[float], scale: float = 1.0) -> Summary:
    """``samples`` times ``scale`` (1e3: seconds to ms); percentiles interpolate linearly
    between ranks, as numpy's default does."""
    if not samples:
        raise ValueError("summary of no samples")
    scaled = [value * scale for value in samples]
    cuts = (
        statistics.quantiles(scaled, n=100, method="inclusive") if len(scaled) > 1 else scaled * 99
    )
    return Summary(len(scaled), statistics.fmean(scaled), cuts[49], cuts[89], cuts[98])


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None if either is missing or the denominator is not > 0."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def median_ratio(rates: Sequence[float], baseline_rates: Sequence[float]) -> float | None:
    """The median over rounds of ``rates[i] / baseline_rates[i]``: two arms that took turns
    in the same round ran under the same conditions, and the median shrugs off a noisy round."""
    pairs = [a / b for a, b in zip(rates, baseline_rates, strict=False) if b > 0]
    return statistics.median(pairs) if pairs else None
