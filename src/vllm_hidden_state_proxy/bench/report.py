"""The results as a markdown report (printed and written) and as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vllm_hidden_state_proxy.bench.embeddings import (
    EMBEDDINGS_DIRECT,
    EMBEDDINGS_PROXY,
    FAN_OUT_LIMIT,
)
from vllm_hidden_state_proxy.bench.results import (
    Arm,
    BenchResults,
    EmbeddingsArm,
    LatencyArm,
    PoolingArm,
    StreamArm,
    TargetCheck,
    ThroughputArm,
    paired_embeddings_ratio,
    paired_ratio,
)
from vllm_hidden_state_proxy.bench.throughput import (
    THROUGHPUT_DIRECT,
    THROUGHPUT_FLAGGED,
    THROUGHPUT_PASSTHROUGH,
)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub markdown table; ``|`` inside cells is escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [line(header), line(["---"] * len(header)), *(line(row) for row in rows)]


def number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _verdict(check: TargetCheck) -> str:
    passed = check.passed
    return "n/a" if passed is None else ("pass" if passed else "**miss**")


def _value(check: TargetCheck) -> str:
    digits = 3 if not check.unit else 1
    text = number(check.value, digits)
    return f"{text} {check.unit}".strip() if check.value is not None else text


def _not_ok(arm: Arm) -> str:
    return f"{arm.status}: {arm.note}" if arm.note else arm.status


def targets_section(results: BenchResults) -> list[str]:
    rows = [
        [
            check.label,
            _value(check),
            f"{check.op} {check.limit:g} {check.unit}".strip(),
            _verdict(check) + (f" ({check.note})" if check.note else ""),
        ]
        for check in results.targets
    ]
    return ["## Targets (issue #6)", "", *table(["measure", "value", "target", "result"], rows)]


def latency_section(results: BenchResults) -> list[str]:
    rows = []
    for arm in results.arms_of(LatencyArm).values():
        s = arm.latency_ms
        if arm.status != "ok" or s is None:
            rows.append([arm.name, arm.description, _not_ok(arm), "", "", "", ""])
            continue
        rows.append(
            [
                arm.name,
                arm.description,
                number(s.p50),
                number(s.p90),
                number(s.p99),
                number(s.mean),
                str(s.n),
            ]
        )
    if not rows:
        return []
    return [
        "## Latency: one-token chat, one request at a time, arms interleaved",
        "",
        *table(["arm", "what", "p50 ms", "p90 ms", "p99 ms", "mean ms", "n"], rows),
    ]


def streaming_section(results: BenchResults) -> list[str]:
    rows = []
    tokens = 0
    for arm in results.arms_of(StreamArm).values():
        if arm.status != "ok" or arm.ttft_ms is None or arm.itl_ms is None or arm.ttlt_ms is None:
            rows.append([arm.name, _not_ok(arm), "", "", "", "", "", ""])
            continue
        tokens = arm.tokens_per_request
        rows.append(
            [
                arm.name,
                number(arm.ttft_ms.p50),
                number(arm.itl_mean_ms, 3),
                number(arm.itl_ms.p50, 3),
                number(arm.itl_ms.p99, 3),
                number(arm.ttlt_ms.p50),
                number(arm.ttlt_ms.p90),
                f"{arm.burst_streams} / {arm.ttft_ms.n}",
            ]
        )
    if not rows:
        return []
    header = [
        "arm",
        "TTFT p50 ms",
        "ITL mean ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "last token p50 ms",
        "last token p90 ms",
        "burst streams",
    ]
    return [
        f"## Streaming: {tokens} tokens a request (unflagged), arms interleaved",
        "",
        *table(header, rows),
        "",
        "Burst streams: tokens that arrived all at once (vLLM's API server sent them back to "
        "back), so their gaps are ~0; see docs/benchmark.md.",
    ]


def throughput_section(results: BenchResults) -> list[str]:
    arms = results.arms_of(ThroughputArm)
    direct = arms.get(THROUGHPUT_DIRECT)
    if direct is None:
        return []
    passthrough = arms.get(THROUGHPUT_PASSTHROUGH)
    flagged = arms.get(THROUGHPUT_FLAGGED)
    rows = []
    for point in direct.points:
        c = point.concurrency
        p = passthrough.at(c) if passthrough else None
        f = flagged.at(c) if flagged else None
        rows.append(
            [
                str(c),
                number(point.requests_per_second, 1),
                number(p.requests_per_second if p else None, 1),
                number(f.requests_per_second if f else None, 1),
                number(paired_ratio(passthrough, direct, c) if passthrough else None, 3),
                number(paired_ratio(flagged, direct, c) if flagged else None, 3),
                number(point.latency_ms.p50),
                number(f.latency_ms.p50 if f else None),
                str(point.requests),
            ]
        )
    header = [
        "concurrency",
        "direct req/s",
        "passthrough req/s",
        "flagged req/s",
        "passthrough / direct",
        "flagged / direct",
        "direct p50 ms",
        "flagged p50 ms",
        "requests per arm",
    ]
    return [
        "## Throughput: one-token chats, N in flight",
        "",
        *table(header, rows),
        "",
        "Rates: all of an arm's requests over all its seconds. Ratios: the median over rounds "
        "of the two arms' rates in the same round (they ran side by side).",
    ]


def embeddings_section(results: BenchResults) -> list[str]:
    arms = results.arms_of(EmbeddingsArm)
    proxy, direct = arms.get(EMBEDDINGS_PROXY), arms.get(EMBEDDINGS_DIRECT)
    if proxy is None:
        return []
    title = "## Embeddings: /v1/embeddings through the proxy, one request of N inputs at a time"
    if proxy.status != "ok":
        return [title, "", _not_ok(proxy)]
    rows = []
    for point in proxy.points:
        n = point.batch_size
        d = direct.at(n) if direct else None
        rows.append(
            [
                str(n),
                number(point.inputs_per_second, 1),
                number(point.requests_per_second, 2),
                number(point.latency_ms.p50),
                number(point.latency_ms.p90),
                number(point.proxy_cpu_ms_per_input, 3),
                number(d.inputs_per_second if d else None, 1),
                number(d.latency_ms.p50 if d else None),
                number(paired_embeddings_ratio(proxy, direct, n) if direct else None, 3),
                f"{point.requests} / {point.inputs}",
            ]
        )
    header = [
        "inputs per request",
        "inputs/s",
        "requests/s",
        "p50 ms",
        "p90 ms",
        "proxy CPU ms per input",
        "same chats straight to vLLM, inputs/s",
        "vLLM alone p50 ms",
        "proxy / vLLM alone, inputs/s",
        "requests / inputs",
    ]
    size = f", hidden size {proxy.hidden_size}" if proxy.hidden_size else ""
    return [
        title,
        "",
        *table(header, rows),
        "",
        f"Distinct short texts, float vectors{size}. vLLM alone: the very one-token chats the "
        f"proxy sends for those inputs, unflagged, at most {FAN_OUT_LIMIT} in flight (the "
        "proxy's default --fan-out-limit); p50 ms is then the time for all N. The two arms "
        "take turns in rounds; the ratio is the median over rounds of their rates in the same "
        "round.",
    ]


def ring_section(results: BenchResults) -> list[str]:
    if not results.ring:
        return []
    rows = [
        [
            str(p.hidden_size),
            f"{p.publish_us.p50:.1f} / {p.publish_us.p99:.1f}",
            f"{p.lookup_us.p50:.1f} / {p.lookup_us.p99:.1f}",
            f"{p.publish_lookup_p50:.1f}",
            f"{p.as_floats_us.p50:.1f}",
            f"{p.json_us.p50:.1f}",
            f"{p.base64_us.p50:.1f}",
        ]
        for p in results.ring
    ]
    header = [
        "hidden size",
        "publish p50 / p99",
        "lookup p50 / p99",
        "publish + lookup p50",
        "as_floats p50",
        "floats -> JSON p50",
        "bytes -> base64 p50",
    ]
    return ["## Ring microbenchmark (µs per call)", "", *table(header, rows)]


def cpu_section(results: BenchResults) -> list[str]:
    if not results.cpu:
        return []
    rows = [
        [cost.arm, number(cost.proxy_ms, 3), number(cost.vllm_ms, 3), str(cost.requests)]
        for cost in results.cpu
    ]
    header = ["arm", "proxy ms", "vLLM ms (all its processes)", "requests"]
    return [
        "## CPU time per request (kernel accounting; arms one after the other)",
        "",
        *table(header, rows),
    ]


def memory_section(results: BenchResults) -> list[str]:
    m = results.memory
    rows = [
        ["proxy, idle", number(m.proxy_rss_idle_mib, 1), ""],
        ["proxy, peak under load (throughput sweep)", number(m.proxy_rss_peak_mib, 1), ""],
        [
            "proxy, peak during the embeddings phase",
            number(m.proxy_rss_peak_embeddings_mib, 1),
            "",
        ],
        ["vLLM chat server (process tree)", number(m.vllm_rss_mib, 1), number(m.vllm_pss_mib, 1)],
    ]
    pooling = next((a for a in results.arms.values() if isinstance(a, PoolingArm)), None)
    if pooling is not None and pooling.status == "ok":
        rows.append(
            [
                "vLLM pooling server (process tree): the alternative's extra",
                number(pooling.rss_mib, 1),
                number(pooling.pss_mib, 1),
            ]
        )
    return ["## Resident memory (MiB)", "", *table(["process", "RSS", "PSS"], rows)]


def pooling_section(results: BenchResults) -> list[str]:
    arm = next((a for a in results.arms.values() if isinstance(a, PoolingArm)), None)
    if arm is None:
        return []
    title = "## The alternative: a second vLLM server with LAST pooling"
    if arm.status != "ok" or arm.latency_ms is None:
        return [title, "", _not_ok(arm)]
    match = "n/a" if arm.prompt_tokens_match is None else str(arm.prompt_tokens_match).lower()
    rows = [
        ["prompts compared", str(arm.prompts_compared)],
        [
            "cosine(ours, pooling), min / mean",
            f"{number(arm.cosine_min, 7)} / {number(arm.cosine_mean, 7)}",
        ],
        ["norm ratio |ours| / |pooling|, mean", number(arm.norm_ratio_mean, 5)],
        ["same prompt token counts", match],
        [
            "/v1/embeddings latency p50 / p90 ms",
            f"{number(arm.latency_ms.p50)} / {number(arm.latency_ms.p90)}",
        ],
        [
            "its own resident memory, RSS / PSS MiB",
            f"{number(arm.rss_mib, 1)} / {number(arm.pss_mib, 1)}",
        ],
        ["startup seconds", number(arm.startup_seconds, 0)],
    ]
    return [title, "", *table(["", "value"], rows)]


def ratios_section(results: BenchResults) -> list[str]:
    rows = [
        [label, number(value, 3)] for label, value in results.ratios.items() if value is not None
    ]
    if not rows:
        return []
    return ["## Other ratios", "", *table(["ratio", "value"], rows)]


def header_section(results: BenchResults) -> list[str]:
    meta = results.meta
    lines = ["# hidden-state-proxy bench", ""]
    for key in ("date", "machine", "load", "mode", "versions", "counts"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    return lines


def render_markdown(results: BenchResults) -> str:
    sections = [
        header_section(results),
        targets_section(results),
        latency_section(results),
        streaming_section(results),
        throughput_section(results),
        embeddings_section(results),
        ring_section(results),
        cpu_section(results),
        memory_section(results),
        pooling_section(results),
        ratios_section(results),
    ]
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"


def write_reports(results: BenchResults, output_dir: Path) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "bench.json"
    markdown_path = output_dir / "bench.md"
    json_path.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    markdown_path.write_text(render_markdown(results))
    return json_path, markdown_path
