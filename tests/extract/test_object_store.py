"""extract on an object store, each test on each of two (the ``store`` fixture): moto's S3 server
(tests/moto_s3.py) and gcp-storage-emulator's GCS (tests/gcs_emulator.py). INPUT and ``--output``
as ``s3://`` or ``gs://`` URIs, a run interrupted and ``--resume``'d, give the dataset a local run
gives (its ids and vectors); what ``--output`` refuses on a disk it refuses there. The
credentials and the endpoint are the environment's, as a user's would be."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.extract.fake_proxy import FakeProxy
from tests.extract.runs import corpus, errors, manifest, options, run, table, write_jsonl
from tests.object_stores import Store
from vllm_hidden_state_proxy.extract import runner
from vllm_hidden_state_proxy.extract.storage import StorePath, location


def _download(store: Store, uri: str, to: Path) -> Path:
    """The dataset at ``uri``, copied to ``to`` (every object, hidden ones included)."""
    fs = store.fs()
    prefix = uri.removeprefix(f"{store.protocol}://")
    to.mkdir()
    for key in fs.find(prefix):
        fs.get_file(key, str(to / key.rsplit("/", 1)[-1]))
    return to


def _by_id(dataset: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in dataset.to_pylist()}


def _interrupt_at(fake: FakeProxy, number: int) -> None:
    async def signal_then_hold(request: int) -> None:
        if request == number:
            os.kill(os.getpid(), signal.SIGINT)  # the run's loop handles it
        if request >= number:
            await fake.stall()

    fake.on_request = signal_then_hold


def test_store_input_and_output_interrupted_and_resumed_equal_a_local_run(
    tmp_path: Path, store: Store
) -> None:
    records = [*corpus(40), {"id": "broken", "prompt": "bad input"}]
    local_input = write_jsonl(tmp_path / "in.jsonl", records)
    bucket = store.bucket()
    store.fs().put_file(str(local_input), f"{bucket}/corpus/in.jsonl")
    at = f"{store.protocol}://{bucket}"
    source, output = f"{at}/corpus/in.jsonl", f"{at}/runs/dataset"

    status, stderr = run(local_input, options(tmp_path / "local"), FakeProxy())
    assert status == runner.EXIT_FAILED, stderr  # the bad input alone
    local = table(tmp_path / "local")

    fake = FakeProxy()
    _interrupt_at(fake, 13)
    opts = options(output, concurrency=4, batch_size=1, rows_per_file=3, row_group_rows=1)
    status, stderr = run(source, opts, fake)
    assert status == runner.EXIT_INTERRUPTED, stderr
    assert fake.stalled and fake.stalled == fake.released
    first = _download(store, output, tmp_path / "first")
    held = set(table(first).column("id").to_pylist())
    assert 0 < len(held) <= 12
    assert not list(first.glob(".*tmp"))  # every part renamed, the manifest in place
    assert manifest(first)["runs"][-1]["state"] == "interrupted"
    assert manifest(first)["runs"][-1]["input"] == source

    again = FakeProxy()
    status, stderr = run(source, options(output, resume=True, batch_size=1), again)
    assert status == runner.EXIT_FAILED, stderr
    assert f"{len(held)} skipped" in stderr
    assert len(again.sent) == 40 - len(held)  # and the bad input, answered 400
    done = _download(store, output, tmp_path / "done")
    assert [r["state"] for r in manifest(done)["runs"]] == ["interrupted", "finished"]
    assert [e["id"] for e in errors(done)] == ["broken"]
    assert manifest(done)["counts"]["ids"] == 40

    remote = table(done)
    assert remote.schema.remove_metadata() == local.schema.remove_metadata()
    assert sorted(remote.column("id").to_pylist()) == sorted(local.column("id").to_pylist())
    assert _by_id(remote) == _by_id(local)  # every vector, position and count


def test_parquet_input_on_a_store_and_a_dataset_read_back_with_pyarrow(
    tmp_path: Path, store: Store
) -> None:
    records = corpus(6)
    bucket = store.bucket()
    fs = store.fs()
    rows = [
        {"id": str(r["id"]), "prompt": r.get("prompt"), "messages": r.get("messages")}
        for r in records
    ]
    with fs.open(f"{bucket}/in.parquet", "wb") as file:
        pq.write_table(pa.Table.from_pylist(rows), file)
    output = f"{store.protocol}://{bucket}/out"
    status, stderr = run(f"{store.protocol}://{bucket}/in.parquet", options(output), FakeProxy())
    assert status == 0, stderr
    assert "6 inputs written" in stderr

    from pyarrow.fs import FSSpecHandler, PyFileSystem

    dataset = pq.read_table(f"{bucket}/out", filesystem=PyFileSystem(FSSpecHandler(fs)))
    assert sorted(dataset.column("id").to_pylist()) == sorted(str(r["id"]) for r in rows)


def test_store_output_refusals_are_the_local_ones(tmp_path: Path, store: Store) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    bucket = store.bucket()
    at = f"{store.protocol}://{bucket}"
    output = f"{at}/out"
    assert run(inputs, options(output), FakeProxy())[0] == 0

    status, stderr = run(inputs, options(output), FakeProxy())
    assert status == runner.EXIT_SETUP and "already holds a dataset: --resume" in stderr

    store.fs().pipe_file(f"{bucket}/stray/part-00000.parquet", b"not ours")
    sent = FakeProxy()
    status, stderr = run(inputs, options(f"{at}/stray", resume=True), sent)
    assert status == runner.EXIT_SETUP and "no _manifest.json" in stderr and not sent.sent

    status, stderr = run(f"{at}/absent.jsonl", options(tmp_path / "x"), FakeProxy())
    assert status == runner.EXIT_SETUP and f"{at}/absent.jsonl does not exist" in stderr


def test_an_output_in_a_bucket_that_is_not_there_is_refused(tmp_path: Path, store: Store) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(1))
    fake = FakeProxy()
    status, stderr = run(inputs, options(f"{store.protocol}://no-such-bucket/out"), fake)
    assert status == runner.EXIT_SETUP, stderr
    assert "the bucket no-such-bucket does not exist" in stderr and not fake.sent
    assert not store.fs().exists("no-such-bucket")


def test_an_unknown_protocol_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(1))
    fake = FakeProxy()
    status, stderr = run(inputs, options("nosuchstore://bucket/out"), fake)
    assert status == runner.EXIT_SETUP and "nosuchstore" in stderr and not fake.sent


@pytest.mark.parametrize(
    ("given", "expected"),
    [("out/dir", Path("out/dir")), ("file:///data/out", Path("/data/out")), ("/abs", Path("/abs"))],
)
def test_paths_and_file_uris_stay_local_paths(given: str, expected: Path) -> None:
    assert location(given) == expected


def test_a_store_path_names_itself_by_its_uri(store: Store) -> None:
    at = f"{store.protocol}://bucket/prefix"
    found = location(f"{at}/")
    assert isinstance(found, StorePath)
    assert str(found) == at
    assert str(found / "_manifest.json") == f"{at}/_manifest.json"
    assert (found / "in.parquet").suffix == ".parquet"


def test_the_manifest_on_a_store_is_json_a_reader_takes(tmp_path: Path, store: Store) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(2))
    bucket = store.bucket()
    assert run(inputs, options(f"{store.protocol}://{bucket}/out"), FakeProxy())[0] == 0
    document = json.loads(store.fs().cat_file(f"{bucket}/out/_manifest.json"))
    assert document["counts"] == {"rows": 2, "ids": 2}
    assert document["parts"] == ["part-00000.parquet"]
