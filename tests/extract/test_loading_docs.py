"""docs/extract.md's "Loading it" snippets, run as written on datasets made through the fake
proxy: the docs' model (1024 wide, layer 28) becomes the fake's (8 wide, layer 2)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.extract.fake_proxy import HIDDEN_SIZE, FakeProxy, expected_vector
from tests.extract.runs import corpus, options, run, write_jsonl

DOC = Path(__file__).resolve().parents[2] / "docs" / "extract.md"


def snippets() -> list[str]:
    """The section's Python blocks: vectors, a matrix column, ``datasets``."""
    section = DOC.read_text(encoding="utf-8").split("\n## Loading it\n", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert len(blocks) == 3, blocks
    for block in blocks:
        assert "layer_28" in block  # what is rewritten is there to rewrite
    return [b.replace("layer_28", "layer_2").replace("1024", str(HIDDEN_SIZE)) for b in blocks]


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
    opts = options(tmp_path / "states", pooling="all_prompt", rows_per_file=4)
    status, stderr = run(inputs, opts, FakeProxy())
    assert status == 0, stderr
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"table": pq.read_table("states/")}  # "of the same table"
    exec(snippets()[1], namespace)
    rows, offsets = namespace["rows"], namespace["offsets"]
    ids = namespace["table"].column("id").to_pylist()
    texts = {r["id"]: r["prompt"] for r in records}
    assert len(offsets) == len(ids) + 1 and offsets[-1] == len(rows)
    for i, id_ in enumerate(ids):
        text = texts[id_]
        want = np.stack([expected_vector(f"{text}#{r}", 2) for r in range(len(text.split()))])
        np.testing.assert_array_equal(rows[offsets[i] : offsets[i + 1]], want)


def test_the_datasets_snippet_loads_the_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("datasets")
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(5))
    status, stderr = run(inputs, options(tmp_path / "states"), FakeProxy())
    assert status == 0, stderr
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(snippets()[2], namespace)
    dataset = namespace["dataset"]
    assert len(dataset) == 5 and dataset[0]["layer_2"].shape == (HIDDEN_SIZE,)
