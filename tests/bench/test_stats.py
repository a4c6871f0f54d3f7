"""Summaries and ratios (bench/stats.py)."""

from __future__ import annotations

import numpy
import pytest

from vllm_hidden_state_proxy.bench.stats import median_ratio, ratio, summarize


def test_percentiles_interpolate_like_numpy() -> None:
    samples = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    summary = summarize(samples)
    assert [summary.p50, summary.p90, summary.p99] == pytest.approx(
        list(numpy.percentile(samples, [50, 90, 99]))
    )
    assert summary.n == 7 and summary.mean == pytest.approx(5.0)


def test_one_sample_is_every_percentile_and_scale_applies_to_all() -> None:
    summary = summarize([0.002], 1e3)
    assert (summary.n, summary.mean, summary.p50, summary.p99) == (1, 2.0, 2.0, 2.0)


def test_no_samples_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError):
        summarize([])


def test_ratio_is_none_when_it_would_mean_nothing() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_median_ratio_pairs_rounds_and_skips_empty_baselines() -> None:
    assert median_ratio([10.0, 9.0, 30.0], [10.0, 10.0, 10.0]) == 1.0  # a noisy round ignored
    assert median_ratio([1.0, 2.0], [0.0, 4.0]) == 0.5
    assert median_ratio([], []) is None
