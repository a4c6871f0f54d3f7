"""Percentiles and summaries (bench/stats.py)."""

from __future__ import annotations

import pytest

from vllm_hidden_state_proxy.bench.stats import percentile, ratio, summarize


def test_percentile_interpolates_like_numpy_default() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]  # order does not matter
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 4.0
    assert percentile(samples, 50) == 2.5
    assert percentile(samples, 90) == pytest.approx(3.7)
    assert percentile(samples, 25) == pytest.approx(1.75)


def test_percentile_of_one_sample_is_that_sample() -> None:
    assert percentile([7.0], 0) == percentile([7.0], 50) == percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy() -> None:
    numpy = pytest.importorskip("numpy")
    samples = [0.3, 9.1, 2.2, 2.2, 5.0, 7.7, 1.0, 4.4, 8.8, 0.1, 6.5]
    for q in (0, 1, 10, 33.3, 50, 90, 99, 100):
        assert percentile(samples, q) == pytest.approx(float(numpy.percentile(samples, q)))


@pytest.mark.parametrize("q", [-1.0, 100.5])
def test_percentile_outside_0_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], q)


def test_no_samples_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        summarize([])


def test_summarize_scales_every_statistic() -> None:
    summary = summarize([0.001, 0.002, 0.003, 0.010], scale=1e3)
    assert summary.n == 4
    assert summary.min == pytest.approx(1.0)
    assert summary.max == pytest.approx(10.0)
    assert summary.mean == pytest.approx(4.0)
    assert summary.p50 == pytest.approx(2.5)
    assert summary.p90 < summary.p99 <= summary.max


def test_ratio_is_none_when_it_would_mean_nothing() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None
