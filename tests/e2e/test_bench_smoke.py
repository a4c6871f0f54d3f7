"""``hidden-state-proxy bench --smoke`` against the shared stack: every arm runs and measures.

Target mode, tiny counts: the shared stack's vLLM, behind a second proxy process (same ring)
that requires an API key, so that ``--api-key`` is exercised too. No timing thresholds (CI
machines are noisy), only that each arm produced positive numbers and the report names every
target.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import RunningStack, proxy_process, wait_healthy
from vllm_hidden_state_proxy.cli import main
from vllm_hidden_state_proxy.protocol import API_KEY_ENV

LATENCY_ARMS = ("direct", "passthrough", "flagged_float")
STREAM_ARMS = ("stream_direct", "stream_proxy")
THROUGHPUT_ARMS = ("throughput_direct", "throughput_passthrough", "throughput_flagged")
CONCURRENCY = (1, 4, 16, 64)
EMBEDDING_ARMS = ("embeddings_proxy", "embeddings_direct")
EMBEDDING_BATCHES = (1, 16, 256)
BENCH_KEY = "e2e-bench-key"


@pytest.fixture(scope="module")
def keyed_proxy(
    stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """A proxy in front of the shared vLLM that wants ``BENCH_KEY``: (its URL, its log)."""
    log = tmp_path_factory.mktemp("keyed-proxy") / "proxy.log"
    env = {API_KEY_ENV: BENCH_KEY}
    with proxy_process(stack.vllm_url, stack.ring_dir, log, env_overrides=env) as (url, process):
        wait_healthy(url + "/health", process, 30, log)
        yield url, log


def bench(stack: RunningStack, proxy_url: str, output: Path, *extra: str) -> int:
    return main(
        [
            "bench",
            "--smoke",
            "--proxy-url",
            proxy_url,
            "--vllm-url",
            stack.vllm_url,
            "--output-dir",
            str(output),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def report(
    stack: RunningStack,
    keyed_proxy: tuple[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    output = tmp_path_factory.mktemp("bench")
    url, log = keyed_proxy
    status = bench(stack, url, output, "--api-key", BENCH_KEY)
    assert status == 0, f"{stack.log_tail()}\n--- keyed proxy:\n{log.read_text()[-3000:]}"
    markdown = (output / "bench.md").read_text()
    assert markdown.startswith("# hidden-state-proxy bench")
    text = (output / "bench.json").read_text()
    assert BENCH_KEY not in text and BENCH_KEY not in markdown
    document: dict[str, Any] = json.loads(text)
    return document


def test_without_the_key_the_keyed_proxy_refuses_the_bench(
    stack: RunningStack,
    keyed_proxy: tuple[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench(stack, keyed_proxy[0], tmp_path, "--no-embeddings") == 1
    assert "HTTP 401" in capsys.readouterr().err


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


def test_embeddings_phase_measures_every_batch_size(report: dict[str, Any]) -> None:
    for name in EMBEDDING_ARMS:
        arm = report["arms"][name]
        assert arm["kind"] == "embeddings" and arm["status"] == "ok", arm
        assert [p["batch_size"] for p in arm["points"]] == list(EMBEDDING_BATCHES)
        for point in arm["points"]:
            assert point["requests"] >= 1
            assert point["inputs"] == point["requests"] * point["batch_size"]
            assert point["inputs_per_second"] > 0 and point["requests_per_second"] > 0
            assert len(point["rounds_ips"]) == 1  # --smoke: one round
            positive_summary(point["latency_ms"])
    proxy = report["arms"]["embeddings_proxy"]
    assert proxy["hidden_size"] > 0
    for point in proxy["points"]:
        assert point["proxy_cpu_ms_per_input"] > 0
    assert report["memory"]["proxy_rss_peak_embeddings_mib"] > 0
    ratios = [v for k, v in report["ratios"].items() if k.startswith("embeddings through")]
    assert len(ratios) == len(EMBEDDING_BATCHES) and all(r > 0 for r in ratios)


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
