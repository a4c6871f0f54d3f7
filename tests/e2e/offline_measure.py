"""Offline hidden states against vLLM's offline pooling runner, on the same prompts and model
(issue #47; a measurement to fold into ``bench`` later, not shipped in the package).

    .venv/bin/python -m tests.e2e.offline_measure [--count 2000] [--rounds 5] [--json out.json]

Three ``LLM``s, each in a process of its own, alive together under the machine-wide vLLM lock,
all on the built-in tiny model in float32 with ``enforce_eager``, fed the same token-id prompts
(``bench``'s extract corpus: 5 to ~100 tokens, no chat template):

- a generation ``LLM`` (the worker hook on, the final layer captured), for three arms: plain
  ``LLM.generate``, one token each, no hidden states (``generate``: what the rest costs on top
  of it), and ``offline.embed(llm, prompts, pooling=..., normalize=False)``, ``last`` and
  ``mean``;
- ``LLM(runner="pooling", convert="embed", pooler_config={"pooling_type": LAST or MEAN,
  "use_activation": False}).embed(prompts)``, one per pooling (the hook off).

Every arm runs the whole corpus once to warm up, then the arms take turns, ``--rounds`` times
(so a machine's changing load falls on all of them alike); the rate is prompts/s of an arm's
median round. The offline vectors are compared with the pooling runner's, by prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hidden_state_proxy.processes import (
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
)
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV, RING_DIR_ENV

OPTIONS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
#: arm -> the LLM (process) that runs it
ARMS = {
    "generate": "generation",
    "offline last": "generation",
    "offline mean": "generation",
    "pooling last": "pooling-last",
    "pooling mean": "pooling-mean",
}
_REPLY_FD = "HSP_MEASURE_REPLY_FD"


def _serve(kind: str, model: Path, corpus: Path) -> None:
    """A child: build the ``LLM`` of ``kind``, then run each arm named on stdin over the
    corpus, replying its seconds (and saving its vectors) on the reply pipe."""
    from vllm import LLM, SamplingParams

    from vllm_hidden_state_proxy import offline

    replies = os.fdopen(int(os.environ.pop(_REPLY_FD)), "w")
    ids = json.loads(corpus.read_text())
    prompts = [{"prompt_token_ids": each} for each in ids]
    if kind.startswith("pooling-"):
        pooler = {"pooling_type": kind.removeprefix("pooling-").upper(), "use_activation": False}
        llm = LLM(str(model), runner="pooling", convert="embed", pooler_config=pooler, **OPTIONS)
    else:
        llm = LLM(str(model), **OPTIONS)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        arm = line.strip()
        start = time.perf_counter()
        vectors = None
        if arm.startswith("pooling"):
            outputs = llm.embed(prompts, use_tqdm=False)
            vectors = np.asarray([output.outputs.embedding for output in outputs], np.float32)
        elif arm.startswith("offline"):
            pooling = arm.removeprefix("offline ")
            vectors = offline.embed(llm, ids, pooling=pooling, normalize=False, use_tqdm=False)
        else:
            llm.generate(prompts, one_token, use_tqdm=False)
        seconds = time.perf_counter() - start
        if vectors is not None:
            np.save(corpus.with_name(arm.replace(" ", "-") + ".npy"), vectors)
        replies.write(f"{seconds}\n")
        replies.flush()


@contextlib.contextmanager
def _child(kind: str, model: Path, corpus: Path, env: dict[str, str]) -> Iterator[Any]:
    read_end, write_end = os.pipe()
    command = [sys.executable, "-m", "tests.e2e.offline_measure", "--serve", kind]
    command += ["--model", str(model), "--corpus", str(corpus)]
    with open(corpus.with_name(f"{kind}.log"), "wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            env={**env, _REPLY_FD: str(write_end)}, pass_fds=(write_end,),
            cwd=Path(__file__).parents[2], start_new_session=True,
        )  # fmt: skip
    os.close(write_end)
    replies = os.fdopen(read_end)
    try:
        if replies.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} LLM did not start: see {log.name}")

        def run(arm: str) -> float:
            assert process.stdin is not None
            process.stdin.write(f"{arm}\n".encode())
            process.stdin.flush()
            return float(replies.readline())

        yield run
    finally:
        stop_process_group(process, kind, grace=30)
        replies.close()


def _compare(a: Any, b: Any) -> tuple[float, float]:
    """(worst cosine, worst relative L2) of ``a``'s rows against ``b``'s, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    relative = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    return float(np.min(cosine)), float(np.max(relative))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.model, args.corpus)
        return

    from transformers import AutoTokenizer

    from vllm_hidden_state_proxy.bench.extract_compare import make_corpus
    from vllm_hidden_state_proxy.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="offline-measure-"))
    model = build_tiny_model(work / "tiny-chat-model")
    corpus_ids = [
        item.tokens for item in make_corpus(AutoTokenizer.from_pretrained(model), args.count)
    ]
    corpus = work / "corpus.json"
    corpus.write_text(json.dumps(corpus_ids))
    env = {**offline_environment(), RING_DIR_ENV: str(work / "rings")}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with (
        one_vllm_at_a_time(lambda: print("waiting for the machine's vLLM lock", flush=True)),
        _child("generation", model, corpus, env) as generation,
        _child("pooling-last", model, corpus, {**env, HOOK_ENABLED_ENV: "0"}) as last,
        _child("pooling-mean", model, corpus, {**env, HOOK_ENABLED_ENV: "0"}) as mean,
    ):
        runs = {"generation": generation, "pooling-last": last, "pooling-mean": mean}
        for arm, kind in ARMS.items():
            runs[kind](arm)  # warm-up
        for _ in range(args.rounds):
            for arm, kind in ARMS.items():
                seconds[arm].append(runs[kind](arm))
    rows = []
    for arm in ARMS:
        row: dict[str, Any] = {
            "arm": arm,
            "prompts_per_s": args.count / statistics.median(seconds[arm]),
            "rounds_s": seconds[arm],
        }
        if arm.startswith("offline"):
            pooling = arm.removeprefix("offline ")
            ours = np.load(work / f"offline-{pooling}.npy")
            theirs = np.load(work / f"pooling-{pooling}.npy")
            row["cosine_min"], row["relative_l2_max"] = _compare(ours, theirs)
        rows.append(row)
    tokens = sum(len(ids) for ids in corpus_ids)
    print(f"{args.count} token-id prompts ({tokens} tokens), tiny model, {OPTIONS}, {work}")
    print("| arm | prompts/s (median round) | rounds (s) | vectors against the pooling runner's |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        against = (
            f"cosine >= {row['cosine_min']:.7f}, relative L2 <= {row['relative_l2_max']:.1e}"
            if "cosine_min" in row
            else ""
        )
        rounds = ", ".join(f"{s:.2f}" for s in row["rounds_s"])
        print(f"| {row['arm']} | {row['prompts_per_s']:.0f} | {rounds} | {against} |")
    if args.json is not None:
        summary = {"count": args.count, "tokens": tokens, "options": OPTIONS, "arms": rows}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":  # vLLM spawns its engine: this must not run again there
    main()
