"""``HiddenStateMapper`` on real vLLM: docs/extract.md's Ray pipeline run as written on a local
Ray cluster of two nodes (tests/e2e/ray_cluster.py), from S3 to S3 (moto's server, its endpoint
and keys in the environment that the nodes inherit), every vector Transformers'; and the page's
``datasets`` example as written."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.doc_blocks import EXTRACT, marked
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_MODEL_LEN, RunningStack
from tests.e2e.test_docs_examples import run_block
from tests.moto_s3 import S3, moto_s3, s3_environment
from vllm_hidden_state_proxy.client import CAPTURE_PATH

TEXTS = 40


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with moto_s3() as server, s3_environment(server):
        yield server


#: Ray on loopback alone, its nodes and its drivers: Ray resolves 127.0.0.1 to the machine's
#: own address unless clusters are "off", which on Linux means only that (ray_cluster.py).
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_address(s3: S3) -> Iterator[str]:
    """A head and a second node, started with S3's variables in their environment."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **RAY_LOOPBACK}
    with subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.ray_cluster", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    ) as process:
        assert process.stdout is not None and process.stdin is not None
        try:
            line = process.stdout.readline()  # once both nodes are up (or the script ended)
            assert line, f"the Ray cluster did not start (exit {process.wait()})"
            cluster = json.loads(line)
            assert cluster["nodes"] == 2
            yield str(cluster["address"])
        finally:
            process.stdin.close()  # the script shuts its nodes down
            process.wait(timeout=120)


def test_the_ray_pipeline_of_the_extract_page_runs_on_two_nodes_s3_to_s3(
    stack: RunningStack, model_name: str, reference: Reference, s3: S3, ray_address: str
) -> None:
    (block,) = marked("ray", EXTRACT)
    fs = s3.fs()
    for name in ("corpora", "datasets"):
        if not fs.exists(name):
            fs.mkdir(name)
    texts = [f"Text number {i} about " + "words " * (i % 5) for i in range(TEXTS)]
    texts[7] = "many " * (MAX_MODEL_LEN + 10)  # longer than the model's context: its error
    corpus = pa.table({"id": [f"t{i}" for i in range(TEXTS)], "prompt": texts})
    sink = io.BytesIO()
    pq.write_table(corpus, sink)
    fs.pipe_file("corpora/texts.parquet", sink.getvalue())

    env = {**s3.env, **RAY_LOOPBACK, "RAY_ADDRESS": ray_address}
    run_block(stack, model_name, block, extra_env=env)

    fs.invalidate_cache()
    parts = sorted(k for k in fs.find("datasets/states-ray") if k.endswith(".parquet"))
    assert parts
    rows = pa.concat_tables(pq.read_table(io.BytesIO(fs.cat_file(k))) for k in parts).to_pylist()
    by_id = {row["id"]: row for row in rows}
    assert sorted(by_id) == sorted(corpus.column("id").to_pylist()) and len(rows) == TEXTS
    failed = by_id.pop("t7")
    assert failed["error"] and failed["layer_0"] is None
    final = reference.num_hidden_layers
    for id_, row in by_id.items():
        assert row["error"] is None, row["error"]
        ids = reference.tokenizer(texts[int(id_[1:])])["input_ids"]
        assert row["num_prompt_tokens"] == len(ids)
        for layer in (0, 1, final):
            expected = reference.layer_vector(ids, layer, "last")
            assert_matches(row[f"layer_{layer}"], expected, f"layer {layer}, last (Ray)")


def test_the_datasets_example_of_the_extract_page_runs(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    (block,) = marked("mapper", EXTRACT)
    env = {
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    printed = run_block(stack, model_name, block, tmp_path, env)
    hidden = httpx.get(stack.proxy_url + CAPTURE_PATH).json()["hidden_size"]
    assert printed.strip().splitlines()[-1] == f"({hidden},)"
