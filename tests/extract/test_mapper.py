"""``HiddenStateMapper`` (extract/mapper.py) against the in-process fake proxy: a batch given as
a dict of lists, Ray's numpy columns, a pyarrow Table or a pandas DataFrame gives the rows
extract writes for the same inputs (its columns, ids and vectors), in the batch's order, a bad
input its ``error`` and not its batch's failure; ``datasets.Dataset.map(batched=True)`` runs it
(the e2e test runs Ray's ``map_batches`` on a real proxy)."""

from __future__ import annotations

import pickle
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tests.extract.fake_proxy import HIDDEN_SIZE, FakeProxy, expected_vector
from tests.extract.runs import URL, corpus, options, run, table, write_jsonl
from vllm_hidden_state_proxy.extract.mapper import (
    ERROR_COLUMN,
    MAPPER_OPTIONS,
    HiddenStateMapper,
    ProxiesUnavailable,
    input_records,
)
from vllm_hidden_state_proxy.extract.options import ExtractOptions


def _columns(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {
        "id": [str(r["id"]) for r in records],
        "prompt": [r.get("prompt") for r in records],
        "messages": [r.get("messages") for r in records],
    }


def _mapper(fake: FakeProxy, **opts: Any) -> HiddenStateMapper:
    return HiddenStateMapper(URL, transport=fake.transport(), **opts)


def test_a_batch_gives_the_rows_extract_writes(tmp_path: Path) -> None:
    records = corpus(12)
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    status, stderr = run(inputs, options(tmp_path / "out", layers=(0, -1)), FakeProxy())
    assert status == 0, stderr
    written = {row["id"]: row for row in table(tmp_path / "out").to_pylist()}

    with _mapper(FakeProxy(), layers=[0, -1]) as mapper:
        mapped = mapper(_columns(records))
    assert isinstance(mapped, pa.Table)
    assert mapped.column_names == [*table(tmp_path / "out").column_names, ERROR_COLUMN]
    assert mapped.column("id").to_pylist() == [str(r["id"]) for r in records]  # in order
    for row in mapped.to_pylist():
        assert row.pop(ERROR_COLUMN) is None
        assert row == written[row["id"]]


def test_a_bad_input_is_its_rows_error_not_its_batchs_failure() -> None:
    records = [
        {"id": 1, "prompt": "fine one"},
        {"id": 2, "prompt": "bad input"},  # the fake answers 400
        {"id": 3, "prompt": "lack 1 layer"},  # a 200 without layer 1: the answer's fault
        {"id": 4, "prompt": "fine two"},
    ]
    columns = _columns(records)
    columns["id"].append(None)  # no id: the input's checks, as extract's
    columns["prompt"].append("no id")
    columns["messages"].append(None)
    with _mapper(FakeProxy()) as mapper:
        rows = mapper(columns).to_pylist()
    assert [row["id"] for row in rows] == ["1", "2", "3", "4", None]
    errors = [row[ERROR_COLUMN] for row in rows]
    assert errors[0] is None and errors[3] is None
    assert errors[1] == "too long"
    assert errors[2] is not None and errors[2].startswith("the answer lacked layer 1")
    assert errors[4] == "no `id` (a non-empty string or an integer)"
    assert rows[1]["layer_0"] is None and rows[1]["position"] is None
    assert rows[0]["layer_0"] == pytest.approx(expected_vector("fine one", 0).tolist())


def test_every_batch_format_gives_one_table() -> None:
    records = corpus(6)
    columns = _columns(records)
    arrow = pa.Table.from_pydict(columns)
    ray_numpy = {name: np.array(values, dtype=object) for name, values in columns.items()}
    ray_numpy["id"] = np.array([str(i) for i in columns["id"]])
    with _mapper(FakeProxy()) as mapper:
        expected = mapper(columns)
        for batch in (arrow, arrow.to_pandas(), ray_numpy, arrow.to_batches()[0]):
            assert mapper(batch).equals(expected), type(batch)


def test_its_options_are_extracts_by_name() -> None:
    assert set(MAPPER_OPTIONS) <= {f.name for f in fields(ExtractOptions)}
    with pytest.raises(TypeError, match="takes no output"):
        HiddenStateMapper(URL, output="s3://x")
    mapper = HiddenStateMapper([URL, "http://other"], layers=[0], pooling="mean")
    assert mapper.options.urls == (URL, "http://other") and mapper.options.layers == (0,)


def test_it_pickles_without_its_client_and_makes_another() -> None:
    fake = FakeProxy()
    with _mapper(fake) as mapper:
        first = mapper({"id": ["x"], "prompt": ["text x"]})
        copy = pickle.loads(pickle.dumps(mapper))
    with copy:
        assert copy({"id": ["x"], "prompt": ["text x"]}).equals(first)


def test_input_records_drop_missing_values_and_numpy() -> None:
    batch = {
        "id": np.array([7, 8]),
        "prompt": np.array(["p", None], dtype=object),
        "messages": [None, np.array([{"role": "user", "content": "hi"}], dtype=object)],
        "other": [1, 2],
    }
    assert input_records(batch) == [
        {"id": 7, "prompt": "p"},
        {"id": 8, "messages": [{"role": "user", "content": "hi"}]},
    ]
    with pytest.raises(ValueError, match="different lengths"):
        input_records({"id": [1, 2], "prompt": ["a"]})


def test_datasets_map_batched_runs_it() -> None:
    import datasets

    records = corpus(10)
    dataset = datasets.Dataset.from_dict(_columns(records))
    with _mapper(FakeProxy(), layers=[0]) as mapper:
        mapped = dataset.map(
            mapper, batched=True, batch_size=4, remove_columns=dataset.column_names
        )
    assert mapped.num_rows == 10 and mapped["id"] == [str(r["id"]) for r in records]
    assert mapped[ERROR_COLUMN] == [None] * 10
    assert np.asarray(mapped["layer_0"][0], dtype=np.float32).shape == (HIDDEN_SIZE,)


def test_datasets_map_in_two_processes_gives_each_its_own_copy() -> None:
    import datasets

    records = corpus(8)
    dataset = datasets.Dataset.from_dict(_columns(records))
    mapper = _mapper(FakeProxy(), layers=[0])
    mapped = dataset.map(
        mapper, batched=True, batch_size=2, num_proc=2, remove_columns=dataset.column_names
    )
    assert mapped["id"] == [str(r["id"]) for r in records]
    assert mapped[ERROR_COLUMN] == [None] * 8
    assert mapper._session is None  # this one was pickled, never called


def test_proxies_busy_past_the_retries_fail_the_batch_not_its_rows() -> None:
    """No input's fault: the batch fails (Ray may run it again), no row says "busy"."""
    with _mapper(FakeProxy(), retries=1) as mapper:
        with pytest.raises(ProxiesUnavailable, match="after 1 retries"):
            mapper({"id": ["a", "b"], "prompt": ["busy 9 a", "busy 9 b"]})
        assert mapper({"id": ["c"], "prompt": ["fine c"]})[ERROR_COLUMN].to_pylist() == [None]
