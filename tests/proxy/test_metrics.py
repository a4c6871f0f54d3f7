"""The proxy's own Prometheus metrics (proxy/metrics.py), rendered by hand."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.metrics import (
    _VECTOR_BYTES,
    CELLS,
    KINDS,
    MISS_REASONS,
    ROWS,
    MetricsTable,
    ProxyMetrics,
)
from vllm_hidden_state_proxy.proxy.vectors.memory import VectorMemory
from vllm_hidden_state_proxy.ring import RingHeader, RingShape

SHAPE = RingShape(8, 4096, 8, 4, (4,))


def headers(count: int, runner: str = "vLLM 0.32.0 V1 CPUModelRunner") -> list[RingHeader]:
    return [RingHeader(SHAPE, 1, 1, engine, 0xAB, runner) for engine in range(count)]


def samples(text: bytes) -> dict[str, float]:
    """Sample name (with labels) -> value; checks every line's shape on the way."""
    values: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        sample, number = line.rsplit(" ", 1)
        assert sample.startswith("hidden_state_proxy_"), line
        values[sample] = float(number)
    return values


def test_every_counter_and_gauge_is_rendered() -> None:
    metrics = ProxyMetrics()
    metrics.requests["flagged"] += 2
    metrics.flagged_received += 3
    metrics.vector_misses["engine_without_ring"] += 1
    metrics.upstream_errors += 4
    text = metrics.render(live_rings=headers(8), engines_without_ring=2, upstream_metrics_up=False)
    values = samples(text)
    assert {k: values[f'hidden_state_proxy_requests_total{{kind="{k}"}}'] for k in KINDS} == {
        "ordinary": 0,
        "flagged": 2,
        "embeddings": 0,
    }
    assert values["hidden_state_proxy_flagged_requests_total"] == 3
    assert {
        r: values[f'hidden_state_proxy_vector_misses_total{{reason="{r}"}}'] for r in MISS_REASONS
    } == {
        "overwritten": 0,
        "not_published": 0,
        "engine_without_ring": 1,
    }
    assert values["hidden_state_proxy_upstream_errors_total"] == 4
    assert values["hidden_state_proxy_live_rings"] == 8
    info = 'hidden_state_proxy_ring_info{instance="00000000000000ab",engine="7",'
    assert values[info + 'runner="vLLM 0.32.0 V1 CPUModelRunner"}'] == 1
    assert values["hidden_state_proxy_engines_without_ring"] == 2
    assert values["hidden_state_proxy_upstream_metrics_up"] == 0
    lines = text.decode().splitlines()
    assert "# TYPE hidden_state_proxy_live_rings gauge" in lines
    assert "# TYPE hidden_state_proxy_engines_without_ring gauge" in lines
    assert "# TYPE hidden_state_proxy_upstream_metrics_up gauge" in lines
    assert "# TYPE hidden_state_proxy_requests_total counter" in lines
    assert text.endswith(b"\n")


def test_the_vector_memory_is_shown_held_refused_and_cut() -> None:
    """Bytes held now (a gauge over the live workers' rows), refusals by the budget's two
    bounds, and clients cut for not taking their answer in time."""
    metrics = ProxyMetrics()
    memory = VectorMemory(total=100, per_request=60, metrics=metrics)
    first, second = memory.share(), memory.share()
    first.take(50)
    with pytest.raises(ProxyError) as too_large:
        first.take(20)
    second.take(40)
    with pytest.raises(ProxyError) as over_budget:
        second.take(15)
    metrics.send_cuts += 1

    def rendered() -> dict[str, float]:
        text = metrics.render(live_rings=[], engines_without_ring=0, upstream_metrics_up=True)
        lines = text.decode().splitlines()
        assert "# TYPE hidden_state_proxy_vector_bytes gauge" in lines
        assert "# TYPE hidden_state_proxy_vector_refusals_total counter" in lines
        assert "# TYPE hidden_state_proxy_send_cuts_total counter" in lines
        return samples(text)

    values = rendered()
    assert (too_large.value.status, over_budget.value.status) == (413, 503)
    assert values["hidden_state_proxy_vector_bytes"] == 90
    assert values['hidden_state_proxy_vector_refusals_total{reason="request"}'] == 1
    assert values['hidden_state_proxy_vector_refusals_total{reason="budget"}'] == 1
    assert values["hidden_state_proxy_send_cuts_total"] == 1
    first.close()
    second.close()
    assert rendered()["hidden_state_proxy_vector_bytes"] == 0


def test_held_vector_bytes_of_a_dead_worker_are_not_shown(tmp_path: Path) -> None:
    path = MetricsTable.create_shared(tmp_path)
    table = MetricsTable(path)
    try:
        metrics = ProxyMetrics(table)
        metrics.vector_bytes = 7
        last = (ROWS - 1) * CELLS  # a worker's row, whose process is gone
        table._cells[last] = 2**22 + 12345  # above the largest pid_max: no such process
        table._cells[last + _VECTOR_BYTES] = 1000
        text = metrics.render(live_rings=[], engines_without_ring=0, upstream_metrics_up=True)
        assert samples(text)["hidden_state_proxy_vector_bytes"] == 7
    finally:
        MetricsTable.remove_shared(path)


def test_a_runner_label_is_escaped() -> None:
    text = ProxyMetrics().render(
        live_rings=headers(1, 'a "b" \\ c'), engines_without_ring=0, upstream_metrics_up=True
    )
    assert b'runner="a \\"b\\" \\\\ c"} 1' in text


def test_histogram_buckets_are_cumulative() -> None:
    metrics = ProxyMetrics()
    for value in (0.00005, 0.0001, 0.003, 0.003, 7.0, 60.0):
        metrics.vector_wait.observe(value)
    values = samples(
        metrics.render(live_rings=headers(1), engines_without_ring=0, upstream_metrics_up=True)
    )
    prefix = 'hidden_state_proxy_vector_wait_seconds_bucket{le="'
    bucket = {k[len(prefix) : -2]: v for k, v in values.items() if k.startswith(prefix)}
    assert bucket["0.0001"] == 2  # le is inclusive
    assert bucket["0.0025"] == 2
    assert bucket["0.005"] == 4
    assert bucket["5.0"] == 4
    assert bucket["10.0"] == 5
    assert bucket["+Inf"] == 6
    counts = list(bucket.values())
    assert counts == sorted(counts)
    assert values["hidden_state_proxy_vector_wait_seconds_count"] == 6
    assert values["hidden_state_proxy_vector_wait_seconds_sum"] == pytest.approx(67.00615)


def test_the_shared_table_is_private_and_never_opened_through_a_link(tmp_path: Path) -> None:
    path = MetricsTable.create_shared(tmp_path)
    assert path.parent.parent == tmp_path and path.parent.name != "hidden-state-proxy-metrics-"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # no one else may add files there
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    table = MetricsTable(path)
    table.close()
    # A link planted where a table is expected (another user's guess) is not followed.
    planted = tmp_path / "planted"
    planted.symlink_to(path)
    with pytest.raises(OSError):
        MetricsTable(planted)
    small = tmp_path / "small"
    small.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a metrics table"):
        MetricsTable(small)
    MetricsTable.remove_shared(path)
    assert not path.parent.exists()
