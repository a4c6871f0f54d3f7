"""docs/extract.md's "Loading it" snippets, run as written on datasets made through the fake
proxy, each value checked: the docs' layer (Qwen3-0.6B's final, ``layer_28``) becomes the tiny
model's, ``layer_2`` (tests/doc_blocks.py), which is the fake's final layer too (8 wide).
tests/e2e/test_docs_examples.py runs them on the datasets the page's own commands make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.doc_blocks import EXTRACT, marked, on_tiny_model
from tests.extract.fake_proxy import HIDDEN_SIZE, NUM_LAYERS, FakeProxy, expected_vector
from tests.extract.runs import corpus, options, run, write_jsonl


def snippets() -> list[str]:
    """The page's Python blocks: vectors, a matrix column, ``datasets``."""
    blocks = [block.code for block in marked("python", EXTRACT)]
    assert len(blocks) == 3, blocks
    for block in blocks:
        assert "layer_28" in block  # what is rewritten is there to rewrite
    assert on_tiny_model("layer_28") == f"layer_{NUM_LAYERS}"
    return [on_tiny_model(block) for block in blocks]


def text_of(record: dict[str, Any]) -> str:
    return str(record["prompt"] if "prompt" in record else record["messages"][-1]["content"])


def test_the_vector_snippet_gives_each_ids_vector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = corpus(30)
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    status, stderr = run(inputs, options(tmp_path / "states", rows_per_file=7), FakeProxy())
    assert status == 0, stderr
    assert len(list((tmp_path / "states").glob("part-*.parquet"))) == 5  # chunks to combine
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(snippets()[0], namespace)
    vectors, ids = namespace["vectors"], namespace["ids"]
    assert vectors.shape == (30, HIDDEN_SIZE)
    texts = {str(r["id"]): text_of(r) for r in records}
    want = np.stack([expected_vector(texts[id_], 2) for id_ in ids])
    np.testing.assert_array_equal(vectors, want)


def test_the_matrix_snippet_gives_each_inputs_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [{"id": f"m{i}", "prompt": " ".join(["w"] * (i + 1)) + f" {i}"} for i in range(6)]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    opts = options(tmp_path / "matrices", pooling="all_prompt", rows_per_file=4)
    status, stderr = run(inputs, opts, FakeProxy())
    assert status == 0, stderr
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(snippets()[1], namespace)  # it reads matrices/, as the command before it wrote
    rows, offsets, matrix = namespace["rows"], namespace["offsets"], namespace["matrix"]
    import pyarrow.parquet as pq

    ids = pq.read_table("matrices/").column("id").to_pylist()
    texts = {r["id"]: r["prompt"] for r in records}
    assert len(matrix) == len(ids) and rows.shape[1] == HIDDEN_SIZE
    assert len(offsets) == len(ids) + 1 and offsets[-1] == len(rows)
    for i, id_ in enumerate(ids):
        text = texts[id_]
        want = np.stack([expected_vector(f"{text}#{r}", 2) for r in range(len(text.split()))])
        np.testing.assert_array_equal(rows[offsets[i] : offsets[i + 1]], want)


def test_the_datasets_snippet_loads_the_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(5))
    status, stderr = run(inputs, options(tmp_path / "states"), FakeProxy())
    assert status == 0, stderr
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(snippets()[2], namespace)
    dataset = namespace["dataset"]
    assert len(dataset) == 5 and dataset[0]["layer_2"].shape == (HIDDEN_SIZE,)
    assert capsys.readouterr().out.strip() == f"({HIDDEN_SIZE},)"
