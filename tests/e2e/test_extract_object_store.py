"""``extract`` with its corpus and its dataset on S3 (moto's server on 127.0.0.1, its endpoint
and keys in the environment as a user's would be), on real vLLM: interrupted with SIGINT once
two parts are on S3, finished with ``--resume``: every input once in the dataset or the errors
file, every vector Transformers'. And docs/extract.md's object-store command, run as written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.doc_blocks import EXTRACT, marked
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import RunningStack
from tests.e2e.test_docs_examples import run_block
from tests.e2e.test_extract import INPUTS, TOO_LONG, command, corpus, token_ids
from tests.moto_s3 import S3, moto_s3
from tests.object_stores import store_environment


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with moto_s3() as server, store_environment(server):
        yield server


def _copy_down(s3: S3, prefix: str, to: Path) -> Path:
    fs = s3.fs()
    to.mkdir()
    for key in fs.find(prefix):
        fs.get_file(key, str(to / key.rsplit("/", 1)[-1]))
    return to


def _wait_for_parts(s3: S3, prefix: str, process: subprocess.Popen[bytes], count: int) -> None:
    fs = s3.fs()
    deadline = time.monotonic() + 60
    while True:
        fs.invalidate_cache()
        found = [k for k in fs.find(prefix) if k.rsplit("/", 1)[-1].startswith("part-")]
        if len(found) >= count:
            return
        assert process.poll() is None, "extract ended before it could be interrupted"
        assert time.monotonic() < deadline, "no part on S3 in 60 s"
        time.sleep(0.05)


def test_s3_to_s3_interrupted_and_resumed_equals_transformers(
    stack: RunningStack, reference: Reference, s3: S3, tmp_path: Path
) -> None:
    records = corpus(reference)
    bucket = s3.bucket()
    s3.fs().pipe_file(
        f"{bucket}/corpus.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode()
    )
    source, output = f"s3://{bucket}/corpus.jsonl", f"s3://{bucket}/dataset"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = command(stack, Path("unused"), Path("unused"))
    argv[argv.index("unused")] = source
    argv[argv.index("unused")] = output

    first = subprocess.Popen([*argv, "--concurrency", "8"], env=env, stderr=subprocess.PIPE)
    _wait_for_parts(s3, f"{bucket}/dataset", first, 2)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr.decode()
    held = set(
        pq.read_table(_copy_down(s3, f"{bucket}/dataset", tmp_path / "first"), columns=["id"])
        .column("id")
        .to_pylist()
    )
    assert 16 <= len(held) < INPUTS, len(held)

    second = subprocess.run([*argv, "--resume"], env=env, stderr=subprocess.PIPE, timeout=300)
    assert second.returncode == 1, second.stderr.decode()  # the input too long failed
    assert f"{len(held)} skipped".encode() in second.stderr

    done = _copy_down(s3, f"{bucket}/dataset", tmp_path / "done")
    errors = [json.loads(line) for line in (done / "_errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["status"]) for e in errors] == [(TOO_LONG, 400)], errors
    assert not list(done.glob(".*.tmp"))
    table = pq.read_table(sorted(done.glob("part-*.parquet")))
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == INPUTS
    manifest = json.loads((done / "_manifest.json").read_text())
    assert [run["state"] for run in manifest["runs"]] == ["interrupted", "finished"]
    assert manifest["runs"][0]["input"] == source

    by_id: dict[str, dict[str, Any]] = {row["id"]: row for row in table.to_pylist()}
    final = reference.num_hidden_layers
    for record in records:
        if record["id"] == TOO_LONG:
            continue
        row = by_id[str(record["id"])]
        for layer in (0, 1, final):
            expected = reference.layer_vector(token_ids(reference, record), layer, "last")
            assert_matches(row[f"layer_{layer}"], expected, f"layer {layer}, last (S3)")


def test_the_object_store_command_of_the_extract_page_runs(
    stack: RunningStack, model_name: str, s3: S3, tmp_path: Path
) -> None:
    """Its buckets made and the page's corpus put at its INPUT; then the block as written."""
    (block,) = marked("object-store", EXTRACT)
    (corpus_block,) = marked("corpus", EXTRACT)
    fs = s3.fs()
    for name in ("corpora", "datasets"):
        if not fs.exists(name):
            fs.mkdir(name)
    from tests.doc_blocks import on_tiny_model

    fs.pipe_file("corpora/corpus.jsonl", on_tiny_model(corpus_block.code).encode())
    run_block(stack, model_name, block, cwd=tmp_path, extra_env=s3.env)
    fs.invalidate_cache()
    manifest = json.loads(fs.cat_file("datasets/states/_manifest.json"))
    assert manifest["counts"]["ids"] == len(corpus_block.code.splitlines())
    assert manifest["runs"][0]["input"] == "s3://corpora/corpus.jsonl"
