"""``hidden-state-proxy bench --smoke`` against the shared stack: every arm runs and measures.

Target mode (the stack's URLs), tiny counts; no timing thresholds (CI machines are noisy), only
that each arm produced positive numbers and the report names every target.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_hidden_state_proxy.cli import main

from .server import RunningStack

LATENCY_ARMS = ("direct", "passthrough", "flagged_float")
STREAM_ARMS = ("stream_direct", "stream_proxy")
THROUGHPUT_ARMS = ("throughput_direct", "throughput_passthrough", "throughput_flagged")
CONCURRENCY = (1, 4, 16, 64)


@pytest.fixture(scope="module")
def report(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("bench")
    status = main(
        [
            "bench",
            "--smoke",
            "--proxy-url",
            stack.proxy_url,
            "--vllm-url",
            stack.vllm_url,
            "--output-dir",
            str(output),
        ]
    )
    assert status == 0, stack.log_tail()
    assert (output / "bench.md").read_text().startswith("# hidden-state-proxy bench")
    document: dict[str, Any] = json.loads((output / "bench.json").read_text())
    return document


def positive_summary(summary: dict[str, Any]) -> None:
    assert summary["n"] >= 1
    assert 0 < summary["min"] <= summary["p50"] <= summary["p99"] <= summary["max"]


def test_latency_arms_measure_every_request(report: dict[str, Any]) -> None:
    arms = report["arms"]
    for name in LATENCY_ARMS:
        assert arms[name]["status"] == "ok", arms[name]
        positive_summary(arms[name]["latency_ms"])
        assert arms[name]["latency_ms"]["n"] == 3
    base64_arm = arms["flagged_base64"]
    assert base64_arm["status"] in ("ok", "unsupported"), base64_arm
    if base64_arm["status"] == "ok":
        positive_summary(base64_arm["latency_ms"])
    assert arms["nginx"]["status"] == "skipped"  # --smoke
    assert arms["pooling"]["status"] == "skipped"


def test_streaming_arms_time_first_and_last_tokens(report: dict[str, Any]) -> None:
    for name in STREAM_ARMS:
        arm = report["arms"][name]
        assert arm["status"] == "ok" and arm["tokens_per_request"] == 64
        positive_summary(arm["ttft_ms"])
        positive_summary(arm["ttlt_ms"])
        assert arm["itl_ms"]["n"] == 63 * arm["ttft_ms"]["n"]  # every token counted
        assert arm["itl_mean_ms"] > 0
        assert arm["ttlt_ms"]["p50"] >= arm["ttft_ms"]["p50"]


def test_throughput_sweep_covers_every_level(report: dict[str, Any]) -> None:
    for name in THROUGHPUT_ARMS:
        arm = report["arms"][name]
        assert arm["status"] == "ok"
        assert [p["concurrency"] for p in arm["points"]] == list(CONCURRENCY)
        for point in arm["points"]:
            assert point["requests"] >= point["concurrency"]
            assert point["requests_per_second"] > 0
            positive_summary(point["latency_ms"])


def test_ring_cpu_memory_and_targets(report: dict[str, Any]) -> None:
    assert [p["hidden_size"] for p in report["ring"]] == [1024, 4096, 8192]
    for point in report["ring"]:
        assert point["publish_us"]["p50"] > 0 and point["lookup_us"]["p50"] > 0
    memory = report["memory"]
    assert memory["proxy_rss_peak_mib"] > 0 and memory["proxy_rss_idle_mib"] > 0
    assert memory["vllm_rss_mib"] > 0
    cpu = {cost["arm"]: cost for cost in report["cpu"]}
    assert set(LATENCY_ARMS) <= set(cpu)
    for name in LATENCY_ARMS:
        assert cpu[name]["vllm_ms"] > 0
    assert cpu["passthrough"]["proxy_ms"] > 0 and cpu["flagged_float"]["proxy_ms"] > 0
    assert len(report["targets"]) == 7
    for check in report["targets"]:  # each measured (no thresholds: CI timing is noise)
        assert check["value"] is not None and check["value"] > 0, check
