"""bench.png: the latency ratios against their targets, throughput ratios over the sweep and,
when the embeddings phase ran, inputs per second by batch size. Needs matplotlib (the ``bench``
extra: ``pip install 'vllm-hidden-state-proxy[bench]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_hidden_state_proxy.bench.embeddings import EMBEDDINGS_DIRECT, EMBEDDINGS_PROXY
from vllm_hidden_state_proxy.bench.results import (
    BenchResults,
    EmbeddingsArm,
    ThroughputArm,
    paired_embeddings_ratio,
    paired_ratio,
)
from vllm_hidden_state_proxy.bench.throughput import (
    THROUGHPUT_DIRECT,
    THROUGHPUT_FLAGGED,
    THROUGHPUT_PASSTHROUGH,
)

#: Target checks drawn in the left panel (ratios below a limit).
_LATENCY_LABELS = (
    ("passthrough / direct, latency p50", "passthrough\n/ direct"),
    ("flagged / direct, latency p50", "flagged\n/ direct"),
    ("flagged / passthrough, latency p50", "flagged\n/ passthrough"),
    ("streaming inter-token latency (mean), proxy / direct", "stream ITL\nproxy / direct"),
)


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(results: BenchResults, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checks = {check.label: check for check in results.targets}
    embeddings = _embeddings_arms(results)
    panels = 3 if embeddings is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    left, right = axes[0], axes[1]

    names, values, limits = [], [], []
    for label, short in _LATENCY_LABELS:
        check = checks.get(label)
        if check is not None and check.value is not None:
            # A check with a note (e.g. the streams came in bursts) is not to be taken at
            # face value: say so under its bar.
            names.append(short + ("\n(see note)" if check.note else ""))
            values.append(check.value)
            limits.append(check.limit)
    for key, short in (
        ("streaming time to last token p50, proxy / direct", "stream last token\nproxy / direct"),
        ("nginx / direct, latency p50", "nginx\n/ direct"),
    ):
        extra = results.ratios.get(key)
        if extra is not None:
            names.append(short)
            values.append(extra)
            limits.append(float("nan"))
    colours = [
        "tab:green" if value <= limit else ("tab:grey" if limit != limit else "tab:red")
        for value, limit in zip(values, limits, strict=True)
    ]
    positions = range(len(names))
    left.bar(positions, values, color=colours)
    for position, limit in zip(positions, limits, strict=True):
        if limit == limit:  # not NaN
            left.hlines(limit, position - 0.4, position + 0.4, colors="black", linestyles="dashed")
    for position, value in zip(positions, values, strict=True):
        left.annotate(f"{value:.3f}", (position, value), ha="center", va="bottom", fontsize=8)
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xticks(list(positions), names, fontsize=8)
    left.set_ylabel("ratio (p50); dashed: target")
    left.set_title("Latency ratios (lower is better)")
    left.set_ylim(bottom=min([0.9, *values]) - 0.02)

    arms = {n: a for n, a in results.arms.items() if isinstance(a, ThroughputArm)}
    direct = arms.get(THROUGHPUT_DIRECT)
    if direct is not None:
        levels = [p.concurrency for p in direct.points]
        for name, label in (
            (THROUGHPUT_FLAGGED, "flagged / direct"),
            (THROUGHPUT_PASSTHROUGH, "passthrough / direct"),
        ):
            arm = arms.get(name)
            if arm is None:
                continue
            series = [paired_ratio(arm, direct, level) or float("nan") for level in levels]
            right.plot(levels, series, marker="o", label=label)
        right.axhline(0.95, color="black", linestyle="dashed", label="target 0.95 (flagged, c=16)")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_xscale("log", base=2)
        right.set_xticks(levels, [str(level) for level in levels])
        right.set_xlabel("requests in flight")
        right.set_ylabel("requests/s ratio (median of rounds)")
        right.set_title("Throughput ratios (higher is better)")
        right.legend(fontsize=8)
    if embeddings is not None:
        _draw_embeddings(axes[2], *embeddings)
    figure.suptitle(f"hidden-state-proxy bench — {results.meta.get('machine', '')}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _embeddings_arms(results: BenchResults) -> tuple[EmbeddingsArm, EmbeddingsArm | None] | None:
    proxy = results.arms.get(EMBEDDINGS_PROXY)
    if not isinstance(proxy, EmbeddingsArm) or proxy.status != "ok" or not proxy.points:
        return None
    direct = results.arms.get(EMBEDDINGS_DIRECT)
    if not isinstance(direct, EmbeddingsArm) or direct.status != "ok":
        return proxy, None
    return proxy, direct


def _draw_embeddings(axis: Any, proxy: EmbeddingsArm, direct: EmbeddingsArm | None) -> None:
    """Grouped bars: inputs/s by batch size, the proxy's and vLLM alone's, ratio on top."""
    batches = [point.batch_size for point in proxy.points]
    positions = list(range(len(batches)))
    width = 0.4
    ours = [point.inputs_per_second for point in proxy.points]
    axis.bar([x - width / 2 for x in positions], ours, width, label="/v1/embeddings (proxy)")
    highest = max(ours)
    if direct is not None:
        theirs = [(p.inputs_per_second if (p := direct.at(b)) else 0.0) for b in batches]
        axis.bar([x + width / 2 for x in positions], theirs, width, label="same chats, vLLM alone")
        highest = max([highest, *theirs])
        for x, batch, mine, base in zip(positions, batches, ours, theirs, strict=True):
            paired = paired_embeddings_ratio(proxy, direct, batch)
            if paired is not None:  # over the pair: proxy / vLLM alone
                top = max(mine, base)
                axis.annotate(f"{paired:.2f}", (x, top), ha="center", va="bottom", fontsize=8)
    axis.set_xticks(positions, [str(batch) for batch in batches])
    axis.set_xlabel("inputs per request")
    axis.set_ylabel("inputs/s (on top: proxy / vLLM alone, median of rounds)")
    axis.set_title("Embeddings per second (higher is better)")
    axis.set_ylim(top=1.3 * highest)  # room for the legend above the bars
    axis.legend(fontsize=8, loc="upper center", ncol=2)
