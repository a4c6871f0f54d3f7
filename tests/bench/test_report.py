"""Target ratios, the markdown report and the JSON (bench/targets.py, report.py, results.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.bench.report import render_markdown, table, write_reports
from vllm_hidden_state_proxy.bench.results import (
    BenchResults,
    CpuCost,
    EmbeddingsArm,
    EmbeddingsPoint,
    LatencyArm,
    Memory,
    PoolingArm,
    RingPoint,
    StreamArm,
    TargetCheck,
    ThroughputArm,
    ThroughputPoint,
    paired_embeddings_ratio,
    paired_ratio,
)
from vllm_hidden_state_proxy.bench.stats import Summary, summarize
from vllm_hidden_state_proxy.bench.targets import evaluate


def flat(value: float, n: int = 10) -> Summary:
    return Summary(n=n, mean=value, p50=value, p90=value, p99=value, min=value, max=value)


def point(concurrency: int, rps: float) -> ThroughputPoint:
    return ThroughputPoint(concurrency, 100, 100 / rps, rps, flat(10.0), [rps, rps, rps])


def embeddings_point(batch: int, ips: float, rounds: list[float]) -> EmbeddingsPoint:
    requests = 1200 // batch
    return EmbeddingsPoint(
        batch, requests, 1200, 1200 / ips, ips, ips / batch, flat(1e3 * batch / ips), rounds
    )


def embeddings_arms() -> tuple[EmbeddingsArm, EmbeddingsArm]:
    proxy = EmbeddingsArm("embeddings_proxy", "/v1/embeddings", hidden_size=128)
    direct = EmbeddingsArm("embeddings_direct", "the same chats to vLLM")
    for batch, ours, theirs in ((1, 50.0, 80.0), (16, 120.0, 150.0), (256, 140.0, 160.0)):
        proxy.points.append(embeddings_point(batch, ours, [ours] * 3))
        proxy.points[-1].proxy_cpu_ms_per_input = 2.0 if batch == 1 else 1.25
        direct.points.append(embeddings_point(batch, theirs, [theirs] * 3))
    return proxy, direct


def sample_results() -> BenchResults:
    results = BenchResults(meta={"date": "2026-01-01T00:00:00+00:00", "machine": "2 cores"})
    results.add(LatencyArm("direct", "to vLLM", latency_ms=flat(10.0)))
    results.add(LatencyArm("passthrough", "via proxy", latency_ms=flat(10.5)))
    results.add(LatencyArm("flagged_float", "flagged", latency_ms=flat(11.5)))
    results.add(LatencyArm("flagged_base64", "base64", "unsupported", "the server answered 400"))
    results.add(LatencyArm("nginx", "nginx", "skipped", "nginx is not installed"))
    for name, itl in (("stream_direct", 2.0), ("stream_proxy", 2.01)):
        results.add(
            StreamArm(name, name, ttft_ms=flat(9.0, 4), itl_ms=flat(itl, 252), itl_mean_ms=itl,
                      ttlt_ms=flat(140.0, 4), burst_streams=1, tokens_per_request=64)
        )  # fmt: skip
    results.add(ThroughputArm("throughput_direct", "d", points=[point(1, 100), point(16, 200)]))
    results.add(ThroughputArm("throughput_passthrough", "p", points=[point(1, 95), point(16, 196)]))
    results.add(ThroughputArm("throughput_flagged", "f", points=[point(1, 90), point(16, 180)]))
    results.add(
        PoolingArm("pooling", "pooling server", latency_ms=flat(12.0), rss_mib=3000.0,
                   pss_mib=2500.0, prompts_compared=8, cosine_min=0.9999999, cosine_mean=1.0,
                   norm_ratio_mean=1.0, prompt_tokens_match=True, startup_seconds=30.0)
    )  # fmt: skip
    for arm in embeddings_arms():
        results.add(arm)
    results.ring = [
        RingPoint(4096, flat(10.0), flat(15.0), flat(50.0), flat(100.0), flat(17.0)),
    ]
    results.cpu = [CpuCost("direct", 50, 0.01, 9.0), CpuCost("passthrough", 50, 1.5, 9.1)]
    results.memory = Memory(
        proxy_rss_idle_mib=45.0,
        proxy_rss_peak_mib=60.0,
        proxy_rss_peak_embeddings_mib=58.5,
        vllm_rss_mib=4000.0,
    )
    evaluate(results)
    return results


def test_targets_are_ratios_against_the_limits_of_issue_6() -> None:
    checks = {check.label: check for check in sample_results().targets}
    assert len(checks) == 7
    flagged_direct = checks["flagged / direct, latency p50"]
    assert flagged_direct.value == pytest.approx(1.15)
    assert flagged_direct.passed is False
    assert checks["passthrough / direct, latency p50"].value == pytest.approx(1.05)
    assert checks["passthrough / direct, latency p50"].passed is True
    assert checks["flagged / passthrough, latency p50"].value == pytest.approx(11.5 / 10.5)
    throughput = checks["flagged / direct, throughput at concurrency 16 (median of rounds)"]
    assert (throughput.value, throughput.op, throughput.passed) == (0.9, ">=", False)
    assert checks["streaming inter-token latency (mean), proxy / direct"].passed is True
    assert checks["ring publish + lookup p50, 4096-d"].value == 25.0
    assert checks["proxy resident memory under load (peak RSS)"].value == 60.0


def test_throughput_ratios_pair_rounds_and_take_the_median() -> None:
    direct = ThroughputArm("throughput_direct", "d")
    flagged = ThroughputArm("throughput_flagged", "f")
    direct.points.append(ThroughputPoint(16, 300, 3.0, 100.0, flat(1.0), [100, 100, 50, 100]))
    # Round 3 was slow for both (noise): paired, it does not move the ratio.
    flagged.points.append(ThroughputPoint(16, 300, 3.0, 100.0, flat(1.0), [90, 95, 45, 300]))
    assert paired_ratio(flagged, direct, 16) == pytest.approx(0.925)  # median of .9 .95 .9 3
    assert paired_ratio(flagged, direct, 4) is None


def test_a_missing_measurement_is_n_a_not_a_pass() -> None:
    check = TargetCheck("x", None, "<=", 1.0)
    assert check.passed is None
    results = BenchResults(meta={})
    evaluate(results)
    assert all(check.value is None and check.passed is None for check in results.targets)
    text = render_markdown(results)
    assert "| n/a | <= 1.1 | n/a |" in text


def test_mostly_burst_streams_put_a_warning_on_the_itl_target() -> None:
    results = sample_results()
    arm = results.arms["stream_proxy"]
    assert isinstance(arm, StreamArm)
    arm.burst_streams = 3
    evaluate(results)
    check = next(c for c in results.targets if "inter-token" in c.label)
    assert "3 of 4 stream_proxy streams came in one burst" in check.note
    assert check.note in render_markdown(results)


def test_markdown_has_every_section_and_the_verdicts() -> None:
    text = render_markdown(sample_results())
    for heading in (
        "## Targets (issue #6)",
        "## Latency",
        "## Streaming: 64 tokens",
        "## Throughput",
        "## Embeddings: /v1/embeddings through the proxy",
        "## Ring microbenchmark",
        "## CPU time per request",
        "## Resident memory (MiB)",
        "## The alternative",
        "## Other ratios",
    ):
        assert heading in text
    assert "| flagged / direct, latency p50 | 1.150 | <= 1.1 | **miss** |" in text
    assert "| passthrough / direct, latency p50 | 1.050 | <= 1.08 | pass |" in text
    assert "| ring publish + lookup p50, 4096-d | 25.0 µs | <= 50 µs | pass |" in text
    assert "| flagged_base64 | base64 | unsupported: the server answered 400 |" in text
    assert "| nginx | nginx | skipped: nginx is not installed |" in text
    assert "| 16 | 200.0 | 196.0 | 180.0 | 0.980 | 0.900 |" in text
    assert "| direct | to vLLM | 10.00 | 10.00 | 10.00 | 10.00 | 10 |" in text
    assert "| passthrough | 1.500 | 9.100 | 50 |" in text
    assert (
        "| 16 | 120.0 | 7.50 | 133.33 | 133.33 | 1.250 | 150.0 | 106.67 | 0.800 | 75 / 1200 |"
        in (text)
    )
    assert "| 1 | 50.0 | 50.00 | 20.00 | 20.00 | 2.000 | 80.0 | 12.50 | 0.625 | 1200 / 1200 |" in (
        text
    )
    assert "hidden size 128" in text
    assert "| proxy, peak during the embeddings phase | 58.5 |  |" in text
    assert (
        "| embeddings through the proxy / the same chats to vLLM alone, inputs/s at 256 inputs "
        "per request (median of rounds) | 0.875 |"
    ) in text


def test_embeddings_ratios_pair_rounds_and_the_memory_target_takes_the_higher_peak() -> None:
    proxy, direct = embeddings_arms()
    proxy.points[1].rounds_ips = [100.0, 10.0, 130.0]  # one round slow for the proxy only
    direct.points[1].rounds_ips = [100.0, 100.0, 100.0, 100.0]  # an extra round: unpaired
    assert paired_embeddings_ratio(proxy, direct, 16) == pytest.approx(1.0)
    assert paired_embeddings_ratio(proxy, direct, 4) is None
    results = sample_results()
    results.memory.proxy_rss_peak_embeddings_mib = 70.0
    evaluate(results)
    check = next(c for c in results.targets if c.label.startswith("proxy resident memory"))
    assert check.value == 70.0
    results.memory = Memory()
    evaluate(results)
    check = next(c for c in results.targets if c.label.startswith("proxy resident memory"))
    assert check.value is None


def test_an_unsupported_embeddings_phase_says_why() -> None:
    results = sample_results()
    results.add(EmbeddingsArm("embeddings_proxy", "e", "unsupported", "the proxy answered 404"))
    results.add(EmbeddingsArm("embeddings_direct", "d", "skipped", "nothing to compare"))
    evaluate(results)
    text = render_markdown(results)
    section = text.split("## Embeddings: ")[1].split("##")[0]
    assert section.splitlines()[2] == "unsupported: the proxy answered 404"
    assert not any(label.startswith("embeddings") for label in results.ratios)


def test_table_escapes_pipes_and_has_a_separator_row() -> None:
    assert table(["a", "b"], [["x|y", "z"]]) == ["| a | b |", "| --- | --- |", "| x\\|y | z |"]


def test_json_has_every_arm_with_its_kind_and_the_checks(tmp_path: Path) -> None:
    json_path, markdown_path = write_reports(sample_results(), tmp_path / "out")
    document = json.loads(json_path.read_text())
    assert markdown_path.read_text().startswith("# hidden-state-proxy bench")
    arms = document["arms"]
    assert arms["direct"] == {
        "kind": "latency",
        "name": "direct",
        "description": "to vLLM",
        "status": "ok",
        "note": "",
        "latency_ms": {"n": 10, "mean": 10.0, "p50": 10.0, "p90": 10.0, "p99": 10.0,
                       "min": 10.0, "max": 10.0},
    }  # fmt: skip
    assert arms["flagged_base64"]["status"] == "unsupported"
    assert arms["stream_proxy"]["kind"] == "streaming"
    assert arms["throughput_flagged"]["points"][1]["requests_per_second"] == 180.0
    assert arms["pooling"]["cosine_min"] == 0.9999999
    embeddings = arms["embeddings_proxy"]
    assert embeddings["kind"] == "embeddings" and embeddings["hidden_size"] == 128
    assert [p["batch_size"] for p in embeddings["points"]] == [1, 16, 256]
    assert embeddings["points"][2]["inputs_per_second"] == 140.0
    assert embeddings["points"][2]["proxy_cpu_ms_per_input"] == 1.25
    assert arms["embeddings_direct"]["points"][0]["proxy_cpu_ms_per_input"] is None
    assert document["memory"]["proxy_rss_peak_embeddings_mib"] == 58.5
    assert document["ring"][0]["publish_lookup_p50_us"] == 25.0
    assert document["cpu"][1] == {"arm": "passthrough", "requests": 50, "proxy_ms": 1.5,
                                  "vllm_ms": 9.1}  # fmt: skip
    assert {check["passed"] for check in document["targets"]} == {True, False}


def test_summaries_round_trip_through_json() -> None:
    summary = summarize([1.0, 2.0, 3.0])
    results = BenchResults(meta={})
    results.add(LatencyArm("direct", "d", latency_ms=summary))
    again = json.loads(json.dumps(results.to_json()))
    assert again["arms"]["direct"]["latency_ms"]["p50"] == 2.0


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from vllm_hidden_state_proxy.bench.plot import draw

    path = draw(sample_results(), tmp_path / "bench.png")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
