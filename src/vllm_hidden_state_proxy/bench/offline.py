"""The offline comparison (issue #47; the phase ``offline``): prompts per second of the offline
API (:func:`vllm_hidden_state_proxy.offline.embed` over a generation ``LLM``, beside its plain
one-token ``generate``) against vLLM's offline pooling runner, on the extract phase's corpus as
token-id prompts, ``last`` and ``mean`` of the final layer. Three ``LLM``s, each in a process of
its own (this module run as a script: :func:`serve`), alive together under the vLLM lock the
caller holds; after a warm-up the arms take turns for the rounds, a rate is the median round's.
The offline vectors are compared by prompt with the pooling runner's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.extract_compare import EXTRACT, agreement, make_corpus
from vllm_hidden_state_proxy.bench.options import EXTRACT_ROUNDS, BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Results, Row, Table
from vllm_hidden_state_proxy.bench.stats import ratio
from vllm_hidden_state_proxy.processes import offline_environment, stop_process_group
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV, RING_DIR_ENV

OPTIONS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
#: The e2e tests' tolerance (the extract phase holds its pooling server to 0.99999).
MIN_COSINE = 0.9999
#: arm -> the ``LLM`` (process) that runs it, in a round's order.
ARMS = {
    "generate, no hidden states": "generation",
    "offline last": "generation",
    "offline mean": "generation",
    "pooling LLM last": "pooling-last",
    "pooling LLM mean": "pooling-mean",
}
TITLE = "Offline: hidden states from an LLM against vLLM's offline pooling runner"
_REPLY_FD = "HSP_BENCH_REPLY_FD"


def serve(kind: str, model: Path, corpus: Path) -> None:
    """A child: build the ``LLM`` of ``kind``, then run each arm named on stdin over the
    corpus, replying its seconds on the reply pipe (and saving its vectors beside the corpus)."""
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
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        arm, start, vectors = line.strip(), time.perf_counter(), None
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
        print(seconds, file=replies, flush=True)


@contextlib.contextmanager
def _child(
    kind: str, model: Path, corpus: Path, env: dict[str, str]
) -> Iterator[Callable[[str], float]]:
    """The ``LLM`` of ``kind`` in a process of its own; yields ``run(arm) -> seconds``."""
    read_end, write_end = os.pipe()
    command = [sys.executable, "-m", __name__, kind, str(model), str(corpus)]
    with open(corpus.with_name(f"{kind}.log"), "wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            env={**env, _REPLY_FD: str(write_end)}, pass_fds=(write_end,), start_new_session=True,
        )  # fmt: skip
    os.close(write_end)
    replies = os.fdopen(read_end)
    try:
        if replies.readline().strip() != "ready":
            raise BenchError(f"the {kind} LLM did not start: see {log.name}")

        def run(arm: str) -> float:
            assert process.stdin is not None
            process.stdin.write(f"{arm}\n".encode())
            process.stdin.flush()
            if not (reply := replies.readline()):
                raise BenchError(f"the {kind} LLM stopped during {arm!r}: see {log.name}")
            return float(reply)

        yield run
    finally:
        stop_process_group(process, kind, grace=30)
        replies.close()
        if process.stdin is not None:
            process.stdin.close()


def _extract_rates(results: Results) -> dict[str, float]:
    """The extract phase's vectors/s by pooling of its token-id prompts (this phase's corpus),
    if it ran in this run."""
    rows = results.tables["extract_compare"].rows if "extract_compare" in results.tables else []
    found = {
        str(r["pooling"]): r["vectors/s"]
        for r in rows
        if r.get("method") == EXTRACT and r.get("input", "ids") == "ids"
    }
    return {pooling: float(rate) for pooling, rate in found.items() if isinstance(rate, float)}


def run(model_dir: Path, options: BenchOptions, progress: Progress, results: Results) -> Table:
    """The phase: three ``LLM`` processes (the caller holds the vLLM lock), its table."""
    from transformers import AutoTokenizer

    rounds = 1 if options.smoke else EXTRACT_ROUNDS
    corpus = make_corpus(AutoTokenizer.from_pretrained(model_dir), options.extract_inputs)
    work = Path(tempfile.mkdtemp(prefix="hsp-bench-offline-"))
    path = work / "corpus.json"
    path.write_text(json.dumps([item.tokens for item in corpus]))
    env = {**offline_environment(), RING_DIR_ENV: str(work / "rings")}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    progress.say(f"offline comparison: {len(corpus)} prompts, three LLMs ({work})")
    try:
        _measure(model_dir, path, env, rounds, seconds, progress)
        rates = {arm: len(corpus) / statistics.median(each) for arm, each in seconds.items()}
        return _table(rates, _extract_rates(results), work, len(corpus))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(
    model_dir: Path, path: Path, env: dict[str, str], rounds: int,
    seconds: dict[str, list[float]], progress: Progress,
) -> None:  # fmt: skip
    with (
        _child("generation", model_dir, path, env) as generation,
        _child("pooling-last", model_dir, path, {**env, HOOK_ENABLED_ENV: "0"}) as last,
        _child("pooling-mean", model_dir, path, {**env, HOOK_ENABLED_ENV: "0"}) as mean,
    ):
        runs = {"generation": generation, "pooling-last": last, "pooling-mean": mean}
        task = progress.task("offline comparison", (rounds + 1) * len(ARMS))
        for turn in range(rounds + 1):  # the first: a warm-up, not counted
            for arm, kind in ARMS.items():
                took = runs[kind](arm)
                seconds[arm] += [took] if turn else []
                task.advance(1)
        task.done()


def _table(
    rates: Mapping[str, float], extract: Mapping[str, float], work: Path, count: int
) -> Table:
    rows: list[Row] = []
    for arm, rate in rates.items():
        pooling = arm.rsplit(" ", 1)[-1] if "last" in arm or "mean" in arm else ""
        row: Row = {"arm": arm, "pooling": pooling, "prompts/s": rate}
        if arm.startswith("offline"):
            row["/ pooling LLM"] = ratio(rate, rates[f"pooling LLM {pooling}"])
            row["/ extract through serve"] = ratio(rate, extract.get(pooling))
            ours, theirs = (
                {str(i): v for i, v in enumerate(np.load(work / f"{side}-{pooling}.npy"))}
                for side in ("offline", "pooling-LLM")
            )
            row["equals the pooling LLM"] = agreement(ours, theirs, MIN_COSINE)
        rows.append(row)
    note = (
        f"{count} token-id prompts (the extract phase's corpus as ids), final layer, {OPTIONS}; "
        "prompts/s of the median round, each LLM in a process of its own. '/ extract through "
        "serve': against the extract phase's rate in this run (empty when it did not run)."
    )
    return Table(TITLE, rows, note)


if __name__ == "__main__":  # vLLM spawns its engine: this must not run again there
    _, kind, model, corpus = sys.argv  # as _child starts it
    serve(kind, Path(model), Path(corpus))
