"""The extract comparison's third method: the model in Transformers, a batched loop of
``output_hidden_states`` forward passes, the final layer pooled as the proxy pools it.

Run as its own process (``python -m vllm_hidden_state_proxy.bench.transformers_loop``) so
that its peak resident memory (``ru_maxrss``) is the loop's alone, not the bench client's.
It reads the comparison's token-id corpus (JSONL: ``id``, ``prompt``), times every batch size
``repeats`` times over the whole corpus and pooling, and writes ``vectors.npz`` (the vectors
of batch size 1, unpadded: what the e2e tests' reference computes, and of the fastest batch
size) and ``timings.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

POOLINGS = ("last", "mean")


def pooled(model: Any, batch: Sequence[Sequence[int]], pad_id: int) -> dict[str, np.ndarray]:
    """The final layer (after the final norm: ``hidden_states[-1]``) of one right-padded batch,
    at each prompt's last position and averaged over its positions (in float64, as the
    reference does), as float32 rows.

    No attention mask goes to the model: with right padding, causal attention already keeps
    every real position from seeing the padding after it (and positions count from 0 as
    unpadded), so the real positions' states are the unpadded ones; a mask would only send
    Transformers down a path ~5x slower here (measured: 169 against 29 ms for 32 x 70 tokens).
    The mask still picks the positions that are pooled."""
    import torch

    longest = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)  # 1: a real position
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
        mask[row, : len(tokens)] = 1
    with torch.inference_mode():
        states = model.model(input_ids=ids, output_hidden_states=True)
    final = states.hidden_states[-1]
    lengths = mask.sum(dim=1)
    last = final[torch.arange(len(batch)), lengths - 1]
    weights = mask.unsqueeze(-1).to(torch.float64)
    mean = (final.to(torch.float64) * weights).sum(dim=1) / lengths.unsqueeze(-1)
    return {
        "last": last.to(torch.float32).numpy(),
        "mean": mean.to(torch.float32).numpy(),
    }


def run_corpus(
    model: Any, corpus: Sequence[Sequence[int]], batch_size: int, pad_id: int
) -> tuple[float, dict[str, np.ndarray]]:
    """Seconds for the whole corpus at ``batch_size`` (both poolings come from one forward
    pass), and the vectors in corpus order. Batches are of prompts of similar length (the
    corpus sorted by length, as one would: less padding computed)."""
    order = sorted(range(len(corpus)), key=lambda index: len(corpus[index]))
    parts: dict[str, list[np.ndarray]] = {p: [] for p in POOLINGS}
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        batch = [corpus[index] for index in order[start : start + batch_size]]
        for pooling, rows in pooled(model, batch, pad_id).items():
            parts[pooling].append(rows)
    seconds = time.perf_counter() - started
    vectors = {}
    for pooling in POOLINGS:
        rows = np.concatenate(parts[pooling])
        vectors[pooling] = np.empty_like(rows)
        vectors[pooling][order] = rows  # back to corpus order
    return seconds, vectors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("inputs", type=Path, help="JSONL: id, prompt (token ids)")
    parser.add_argument("output", type=Path, help="a directory (created)")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in args.inputs.read_text().splitlines() if line]
    ids = [str(r["id"]) for r in records]
    corpus = [list(r["prompt"]) for r in records]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    pad_id = int(tokenizer.pad_token_id or 0)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]

    run_corpus(model, corpus[: max(sizes)], max(sizes), pad_id)  # warm-up: allocator, threads
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    vectors: dict[int, dict[str, np.ndarray]] = {}
    for _ in range(args.repeats):
        for size in sizes:  # in turns, so that the machine's moods fall on every size
            took, vectors[size] = run_corpus(model, corpus, size, pad_id)
            seconds[size].append(took)
    rates = {size: len(corpus) / statistics.median(seconds[size]) for size in sizes}
    best = max(sizes, key=lambda size: rates[size])
    args.output.mkdir(parents=True, exist_ok=True)
    reference = vectors[1] if 1 in vectors else run_corpus(model, corpus, 1, pad_id)[1]
    arrays: dict[str, Any] = {"ids": np.array(ids)}
    arrays.update({f"reference_{p}": reference[p] for p in POOLINGS})
    arrays.update({f"best_{p}": vectors[best][p] for p in POOLINGS})
    np.savez(args.output / "vectors.npz", **arrays)
    timings = {
        "inputs": len(corpus),
        "tokens": sum(len(c) for c in corpus),
        "torch_threads": torch.get_num_threads(),
        "batch_sizes": {
            str(size): {"seconds": seconds[size], "rate": rates[size]} for size in sizes
        },
        "best_batch_size": best,
        # Linux reports KiB: the most this process (model, torch, the batches) held at once.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (args.output / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
