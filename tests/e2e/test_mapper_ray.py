"""``HiddenStateMapper`` on real vLLM: docs/extract.md's Ray pipeline run as written on a local
Ray cluster of two nodes (tests/e2e/ray_cluster.py), from S3 to S3 (moto's server, its endpoint
and keys in the environment that the nodes inherit), every vector Transformers'; the same
pipeline with one of its actors' processes killed mid-run (every input still once in the
dataset); and the page's ``datasets`` example as written."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.doc_blocks import EXTRACT, marked
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_MODEL_LEN, RunningStack
from tests.e2e.test_docs_examples import run_block
from tests.moto_s3 import S3, moto_s3
from tests.object_stores import store_environment
from vllm_hidden_state_proxy.client import CAPTURE_PATH

TEXTS = 40


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with moto_s3() as server, store_environment(server):
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


def corpus_texts() -> list[str]:
    texts = [f"Text number {i} about " + "words " * (i % 5) for i in range(TEXTS)]
    texts[7] = "many " * (MAX_MODEL_LEN + 10)  # longer than the model's context: its error
    return texts


def put_corpus(s3: S3, texts: list[str], paths: list[str]) -> None:
    """``texts`` in S3 as Parquet (ids ``t0``, ``t1``...), split in order among ``paths``."""
    fs = s3.fs()
    for name in ("corpora", "datasets"):
        if not fs.exists(name):
            fs.mkdir(name)
    corpus = pa.table({"id": [f"t{i}" for i in range(len(texts))], "prompt": texts})
    size = -(-len(texts) // len(paths))
    for n, path in enumerate(paths):
        sink = io.BytesIO()
        pq.write_table(corpus.slice(n * size, size), sink)
        fs.pipe_file(path, sink.getvalue())


def check_dataset(s3: S3, prefix: str, texts: list[str], reference: Reference) -> None:
    """The dataset Ray wrote under ``prefix``: every input of ``texts`` once (no id lost, none
    twice), its vectors Transformers', ``t7``'s failure in its ``error``."""
    fs = s3.fs()
    fs.invalidate_cache()
    parts = sorted(k for k in fs.find(prefix) if k.endswith(".parquet"))
    assert parts
    rows = pa.concat_tables(pq.read_table(io.BytesIO(fs.cat_file(k))) for k in parts).to_pylist()
    ids = [row["id"] for row in rows]
    assert sorted(ids) == sorted(f"t{i}" for i in range(len(texts))), ids
    by_id = {row["id"]: row for row in rows}
    failed = by_id.pop("t7")
    assert failed["error"] and failed["layer_0"] is None
    final = reference.num_hidden_layers
    for id_, row in by_id.items():
        assert row["error"] is None, row["error"]
        tokens = reference.tokenizer(texts[int(id_[1:])])["input_ids"]
        assert row["num_prompt_tokens"] == len(tokens)
        for layer in (0, 1, final):
            expected = reference.layer_vector(tokens, layer, "last")
            assert_matches(row[f"layer_{layer}"], expected, f"layer {layer}, last (Ray)")


def test_the_ray_pipeline_of_the_extract_page_runs_on_two_nodes_s3_to_s3(
    stack: RunningStack, model_name: str, reference: Reference, s3: S3, ray_address: str
) -> None:
    (block,) = marked("ray", EXTRACT)
    texts = corpus_texts()
    put_corpus(s3, texts, ["corpora/texts.parquet"])

    env = {**s3.env, **RAY_LOOPBACK, "RAY_ADDRESS": ray_address}
    run_block(stack, model_name, block, extra_env=env)

    check_dataset(s3, "datasets/states-ray/", texts, reference)


#: The mapper of the pipeline whose actor is killed: HiddenStateMapper, which once a batch is
#: served (its rows made) leaves a file named by its process with the batch's ids, then holds
#: the rows until the test has killed a process (``killed``): so one dies with a batch served
#: and not handed to Ray, and every other waits for the kill, none done before it.
KILLED_ONCE = """
import json as _json
import os as _os
import pathlib as _pathlib
import time as _time

MARKERS = _pathlib.Path({markers!r})


class KilledOnce(HiddenStateMapper):
    def __call__(self, batch):
        table = super().__call__(batch)
        ids = table.column("id").to_pylist()
        name = f"served-{{_os.getpid()}}-{{ids[0]}}"
        (MARKERS / ("." + name)).write_text(_json.dumps(ids))
        (MARKERS / ("." + name)).rename(MARKERS / name)  # whole when seen
        while not (MARKERS / "killed").exists():
            _time.sleep(0.05)
        return table
"""
#: The killed run's corpus: one file a read task (a batch each, ``batch_size`` being larger).
KILL_FILES = 5


def kill_the_first_to_serve(markers: Path, done: threading.Event, killed: list[int]) -> None:
    """SIGKILL the process of the first batch served (its rows made, not handed back), then
    say so in ``markers`` (``killed``); until ``done`` (the pipeline ended first)."""
    while not done.is_set():
        served = sorted(markers.glob("served-*"))
        if served:
            pid = int(served[0].name.split("-")[1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            (markers / "killed").touch()
            return
        done.wait(0.05)


def test_the_ray_pipeline_gives_every_input_once_when_an_actors_process_is_killed(
    stack: RunningStack,
    model_name: str,
    reference: Reference,
    s3: S3,
    ray_address: str,
    tmp_path: Path,
) -> None:
    """The page's pipeline, its input in several files, one of its two mappers' processes
    killed (SIGKILL) once it has served a batch: Ray Data's actor pool restarts the actor and
    runs its tasks again, and the dataset holds every input exactly once."""
    (block,) = marked("ray", EXTRACT)
    texts = corpus_texts()
    put_corpus(s3, texts, [f"corpora/texts-kill/part-{n}.parquet" for n in range(KILL_FILES)])
    markers = tmp_path / "markers"
    markers.mkdir()
    code = block.code
    for old, new in (
        ("HiddenStateMapper,\n", "KilledOnce,\n"),
        ('"s3://corpora/texts.parquet"', '"s3://corpora/texts-kill/"'),
        ('"s3://datasets/states-ray/"', '"s3://datasets/states-ray-kill/"'),
    ):
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    imported = "from vllm_hidden_state_proxy.extract.mapper import HiddenStateMapper\n"
    assert code.count(imported) == 1
    code = code.replace(imported, imported + KILLED_ONCE.format(markers=str(markers)))

    env = {**s3.env, **RAY_LOOPBACK, "RAY_ADDRESS": ray_address}
    done = threading.Event()
    killed: list[int] = []
    killer = threading.Thread(target=kill_the_first_to_serve, args=(markers, done, killed))
    killer.start()
    try:
        run_block(stack, model_name, replace(block, code=code), extra_env=env)
    finally:
        done.set()
        killer.join()

    assert killed, "the pipeline ended with no batch served"
    served = {path.name: json.loads(path.read_text()) for path in markers.glob("served-*")}
    by_killed = [ids for name, ids in served.items() if name.startswith(f"served-{killed[0]}-")]
    by_others = {id_ for name, ids in served.items() if f"-{killed[0]}-" not in name for id_ in ids}
    assert by_killed and set(by_killed[0]) <= by_others, (killed, served)  # served again
    check_dataset(s3, "datasets/states-ray-kill/", texts, reference)


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
