"""``hidden-state-proxy bench --smoke`` against the shared stack: every phase runs and measures.

Target mode, tiny counts: the shared stack's vLLM, behind a second proxy process (same ring)
that requires an API key, so that ``--api-key`` is exercised too. No timing thresholds (CI
machines are noisy), only that each phase produced positive numbers and the report names every
target.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import RunningStack, proxy_process, wait_healthy
from vllm_hidden_state_proxy.bench.report import TARGETS
from vllm_hidden_state_proxy.cli import main
from vllm_hidden_state_proxy.protocol import API_KEY_ENV

BENCH_KEY = "e2e-bench-key"


@pytest.fixture(scope="module")
def keyed_proxy(
    stack: RunningStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """A proxy in front of the shared vLLM that wants ``BENCH_KEY``: (its URL, its log)."""
    log = tmp_path_factory.mktemp("keyed-proxy") / "proxy.log"
    env = {API_KEY_ENV: BENCH_KEY, **stack.upstream_environment()}
    with proxy_process(stack.vllm_url, stack.ring_dir, log, env_overrides=env) as (url, process):
        wait_healthy(url + "/health", process, 30, log)
        yield url, log


def bench(stack: RunningStack, proxy_url: str, output: Path, *extra: str) -> int:
    argv = ["bench", "--smoke", "--proxy-url", proxy_url, "--vllm-url", stack.vllm_url]
    if stack.vllm_api_key:  # the direct arms
        argv += ["--vllm-api-key", stack.vllm_api_key]
    return main([*argv, "--output-dir", str(output), *extra])


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
    # The figures: each a PNG next to the report, linked from it.
    links = [link["file"] for links in document["figures"].values() for link in links]
    assert links == ["bench-latency.png"]
    for name in links:
        assert (output / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in markdown
    return document


def rows(report: dict[str, Any], table: str) -> dict[Any, dict[str, Any]]:
    """The rows of one table, by their first cell."""
    return {next(iter(row.values())): row for row in report["tables"][table]["rows"]}


def positive(row: dict[str, Any], *columns: str) -> None:
    for column in columns:
        assert isinstance(row[column], (int, float)) and row[column] > 0, (column, row)


def test_without_the_key_the_keyed_proxy_refuses_the_bench(
    stack: RunningStack,
    keyed_proxy: tuple[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench(stack, keyed_proxy[0], tmp_path, "--phases", "latency") == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_latency_and_cpu_per_request_of_every_arm(report: dict[str, Any]) -> None:
    latency, cpu = rows(report, "latency"), rows(report, "cpu")
    assert (
        list(latency)
        == list(cpu)
        == ["direct", "direct_hooked", "passthrough", "flagged_float", "flagged_base64"]
    )
    for name, row in latency.items():
        assert row["n"] == 3
        positive(row, "p50 ms", "p99 ms", "p50 / direct")
        positive(cpu[name], "vLLM CPU ms")
        if not name.startswith("direct"):
            positive(cpu[name], "proxy CPU ms")


def test_streaming_times_first_and_last_tokens(report: dict[str, Any]) -> None:
    streaming = rows(report, "streaming")
    for row in streaming.values():
        assert row["n"] == 2 and row["gaps"] == 2 * 63  # every token counted
        positive(row, "TTFT p50 ms", "ITL mean ms", "last token p50 ms")
        assert row["last token p50 ms"] >= row["TTFT p50 ms"]
    positive(streaming["stream_proxy"], "ITL mean / direct")


def test_throughput_covers_every_level(report: dict[str, Any]) -> None:
    throughput = rows(report, "throughput")
    assert list(throughput) == [1, 4, 16, 64]
    for level, row in throughput.items():
        assert row["requests per arm"] >= level
        positive(row, "direct req/s", "passthrough req/s", "flagged req/s", "flagged / direct")


def test_embeddings_cover_every_batch_size(report: dict[str, Any]) -> None:
    embeddings = rows(report, "embeddings")
    assert list(embeddings) == [1, 16, 256]
    for row in embeddings.values():
        positive(row, "inputs/s", "vLLM alone inputs/s", "proxy / vLLM alone, inputs/s")
        positive(row, "requests", "hidden size")


def test_memory_and_every_target(report: dict[str, Any]) -> None:
    memory = rows(report, "memory")
    for row in memory.values():
        positive(row, "RSS MiB")
    assert len(report["targets"]) == len(TARGETS)
    for target in report["targets"]:  # all measured (no thresholds: CI timing is noise)
        assert target["value"] is not None and target["value"] > 0, target
