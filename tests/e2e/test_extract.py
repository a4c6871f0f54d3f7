"""``hidden-state-proxy extract`` on real vLLM (issue #38): a corpus of chats, texts and token
ids, one input too long for the model, interrupted with SIGINT mid-run and finished with
``--resume``: every input ends in the dataset or the errors file, once, and every vector equals
Transformers'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import COUNTED, Reference, assert_matches
from tests.e2e.server import MAX_MODEL_LEN, SHARED_LAYERS, RunningStack

INPUTS = 300
TOO_LONG = "too-long"


def corpus(reference: Reference) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for i in range(INPUTS):
        words = " ".join(["word"] * (i % 7)) + f" number {i}"
        if i % 3 == 0:
            records.append({"id": f"chat-{i}", "messages": [{"role": "user", "content": words}]})
        elif i % 3 == 1:
            records.append({"id": i, "prompt": f"A text about {words}."})
        else:
            ids = reference.tokenizer(f"Token ids of {words}.")["input_ids"]
            records.append({"id": f"ids-{i}", "prompt": list(ids)})
    records.insert(INPUTS // 2, {"id": TOO_LONG, "prompt": "many " * (MAX_MODEL_LEN + 10)})
    return records


def token_ids(reference: Reference, record: dict[str, Any]) -> list[int]:
    if "messages" in record:
        return reference.chat_token_ids(record["messages"], enable_thinking=False)
    prompt = record["prompt"]
    return list(prompt) if isinstance(prompt, list) else reference.tokenizer(prompt)["input_ids"]


def command(stack: RunningStack, inputs: Path, output: Path, *more: str) -> list[str]:
    return [
        sys.executable, "-m", "vllm_hidden_state_proxy.cli", "extract", str(inputs),
        "--url", stack.proxy_url, "--url", stack.proxy_url, "--output", str(output),
        "--layers", ",".join(SHARED_LAYERS), "--extra-body", json.dumps(NO_THINKING),
        "--row-group-rows", "8", "--rows-per-file", "16", *more,
    ]  # fmt: skip


def wait_for_parts(output: Path, process: subprocess.Popen[bytes], count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(output.glob("part-*.parquet"))) < count:
        assert process.poll() is None, "extract ended before it could be interrupted"
        assert time.monotonic() < deadline, "no part file written in 60 s"
        time.sleep(0.02)


def interrupted_run(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], bytes]:
    """``extract`` interrupted (SIGINT) once it has written two parts, and its error output.

    It runs one input at a time and stands still (SIGSTOP) while the interrupt is sent, so it
    cannot finish the corpus between the test seeing the parts and the interrupt: it goes on
    (SIGCONT) only to find the interrupt waiting.
    """
    first = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
    wait_for_parts(Path(argv[argv.index("--output") + 1]), first, 2)
    first.send_signal(signal.SIGSTOP)
    first.send_signal(signal.SIGINT)
    first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=60)
    return first, stderr


def test_extract_a_corpus_interrupted_and_resumed_equals_transformers(
    stack: RunningStack, reference: Reference, tmp_path: Path
) -> None:
    records = corpus(reference)
    inputs = tmp_path / "corpus.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    output = tmp_path / "dataset"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    first, stderr = interrupted_run(command(stack, inputs, output, "--concurrency", "1"), env)
    assert first.returncode == 130, stderr.decode()
    assert b"interrupted: run again with --resume" in stderr
    held = set(pq.read_table(output, columns=["id"]).column("id").to_pylist())
    assert 16 <= len(held) < INPUTS, len(held)

    started = time.monotonic()
    second = subprocess.run(
        command(stack, inputs, output, "--resume"), env=env, stderr=subprocess.PIPE, timeout=300
    )
    seconds = time.monotonic() - started
    assert second.returncode == 1, second.stderr.decode()  # the input too long failed
    assert f"{len(held)} skipped".encode() in second.stderr

    errors = [json.loads(line) for line in (output / "_errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["status"]) for e in errors] == [(TOO_LONG, 400)], errors
    table = pq.read_table(sorted(output.glob("part-*.parquet")))
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == INPUTS  # none lost, none twice
    assert set(ids) == {str(r["id"]) for r in records} - {TOO_LONG}
    assert not list(output.glob(".*.tmp"))
    manifest = json.loads((output / "_manifest.json").read_text())
    final = reference.num_hidden_layers
    assert manifest["layers"] == [0, 1, final] and manifest["counts"]["rows"] == INPUTS
    assert [run["state"] for run in manifest["runs"]] == ["interrupted", "finished"]

    by_id = {row["id"]: row for row in table.to_pylist()}
    for record in records:
        if record["id"] == TOO_LONG:
            continue
        row = by_id[str(record["id"])]
        ids_of = token_ids(reference, record)
        assert row["num_prompt_tokens"] == len(ids_of) and row["position"] == len(ids_of) - 1
        for layer in (0, 1, final):
            expected = reference.layer_vector(ids_of, layer, "last")
            assert_matches(row[f"layer_{layer}"], expected, f"layer {layer}, last (extract)")
    resumed = INPUTS - len(held)
    COUNTED.append(
        f"extract: {resumed} inputs in {seconds:.1f} s with --resume "
        f"({resumed / seconds:.1f} inputs/s, process start included; "
        f"{manifest['runs'][1]['inputs_per_second']} inputs/s as the manifest counts)"
    )


def test_extract_matrices_and_spans_equal_transformers_rows(
    stack: RunningStack, reference: Reference, tmp_path: Path
) -> None:
    records = [
        {"id": f"m{i}", "prompt": f"Every position of prompt {i}: " + "more " * i}
        for i in range(12)
    ]
    inputs = tmp_path / "matrices.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    output = tmp_path / "all_prompt"
    done = subprocess.run(
        command(stack, inputs, output, "--pooling", "all_prompt"), env=env, stderr=subprocess.PIPE
    )
    assert done.returncode == 0, done.stderr.decode()
    final = reference.num_hidden_layers
    for row in pq.read_table(output).to_pylist():
        ids_of = token_ids(reference, next(r for r in records if r["id"] == row["id"]))
        for layer in (0, 1, final):
            expected = reference.layer_rows(ids_of, layer)
            assert len(row[f"layer_{layer}"]) == len(expected) == row["num_prompt_tokens"]
            for actual, want in zip(row[f"layer_{layer}"], expected, strict=True):
                assert_matches(actual, want, f"layer {layer}, all_prompt (extract)")

    spans = [[0, 1], [1, 4], [0, 5]]
    with_spans = [{**record, "spans": spans} for record in records]
    inputs.write_text("".join(json.dumps(r) + "\n" for r in with_spans), encoding="utf-8")
    output = tmp_path / "spans"
    done = subprocess.run(
        command(stack, inputs, output, "--spans"), env=env, stderr=subprocess.PIPE
    )
    assert done.returncode == 0, done.stderr.decode()
    for row in pq.read_table(output).to_pylist():
        ids_of = token_ids(reference, next(r for r in records if r["id"] == row["id"]))
        for layer in (0, 1, final):
            every = reference.layer_rows(ids_of, layer)
            for actual, (start, end) in zip(row[f"layer_{layer}"], spans, strict=True):
                want = [
                    sum(r[j] for r in every[start:end]) / (end - start)
                    for j in range(len(every[0]))
                ]
                assert_matches(actual, want, f"layer {layer}, spans (extract)")


def test_extract_with_its_defaults_takes_no_front_door_503s(
    stack: RunningStack, tmp_path: Path
) -> None:
    """More inputs than the default serve takes connections (1024), with extract's defaults:
    its in flight stays below what the proxy's front server accepts (issue #50: at 1024 against
    1024 the front server refused hundreds with its plain-text 503)."""
    inputs = tmp_path / "short.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"Short text {i}."}) + "\n" for i in range(1100)]
    inputs.write_text("".join(lines), encoding="utf-8")
    output = tmp_path / "defaults"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    defaults = [sys.executable, "-m", "vllm_hidden_state_proxy.cli", "extract", str(inputs),
                "--url", stack.proxy_url, "--output", str(output), "--layers", "-1"]  # fmt: skip
    done = subprocess.run(defaults, env=env, stderr=subprocess.PIPE, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    manifest = json.loads((output / "_manifest.json").read_text())
    connections = manifest["capture"]["limits"]["max_client_connections"]
    [run] = manifest["runs"]
    assert run["concurrency"] < connections and run["inputs_written"] == 1100
    assert "503 front server" not in run["retries_by_cause"], run["retries_by_cause"]


def test_extract_in_small_batches_with_mean_pooling_equals_transformers(
    stack: RunningStack, reference: Reference, tmp_path: Path
) -> None:
    """Batches of 5 (texts, token ids and chats each their own), mean pooling, one input too
    long for the model in a batch of texts: it fails alone, every other vector is its own
    prompt's (issue #46)."""
    records = corpus(reference)[:40]
    records.insert(7, {"id": TOO_LONG, "prompt": "many " * (MAX_MODEL_LEN + 10)})
    inputs = tmp_path / "corpus.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    output = tmp_path / "batched"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    more = ("--batch-size", "5", "--pooling", "mean")
    done = subprocess.run(
        command(stack, inputs, output, *more), env=env, stderr=subprocess.PIPE, timeout=300
    )
    assert done.returncode == 1, done.stderr.decode()  # the input too long failed
    errors = [json.loads(line) for line in (output / "_errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["status"], e["line"]) for e in errors] == [(TOO_LONG, 400, 8)], errors
    rows = pq.read_table(output).to_pylist()
    assert sorted(row["id"] for row in rows) == sorted(
        str(r["id"]) for r in records if r["id"] != TOO_LONG
    )
    final = reference.num_hidden_layers
    by_id = {str(r["id"]): r for r in records}
    for row in rows:
        ids_of = token_ids(reference, by_id[row["id"]])
        assert row["num_prompt_tokens"] == len(ids_of)
        for layer in (0, 1, final):
            expected = reference.layer_vector(ids_of, layer, "mean")
            assert_matches(row[f"layer_{layer}"], expected, f"layer {layer}, mean (extract)")
