"""The offline phase's table (bench/offline.py): ratios by pooling, vectors compared by prompt,
the extract phase's rate taken from the same run's table when it ran."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_hidden_state_proxy.bench import offline
from vllm_hidden_state_proxy.bench.extract_compare import EXTRACT
from vllm_hidden_state_proxy.bench.report import Results, Table

RATES = {arm: 100.0 + 10 * number for number, arm in enumerate(offline.ARMS)}


def saved(work: Path, shift: float = 0.0) -> None:
    vectors = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    for pooling in ("last", "mean"):
        np.save(work / f"offline-{pooling}.npy", vectors + shift)
        np.save(work / f"pooling-LLM-{pooling}.npy", vectors)


def test_offline_rows_carry_ratios_to_the_pooling_llm_and_to_extract(tmp_path: Path) -> None:
    saved(tmp_path)
    results = Results(meta={})
    rows = [{"method": EXTRACT, "pooling": "last", "vectors/s": 55.0}]
    results.tables["extract_compare"] = Table("x", rows)  # type: ignore[arg-type]
    table = offline._table(RATES, offline._extract_rates(results), tmp_path, 4)
    by_arm = {row["arm"]: row for row in table.rows}
    last, mean = by_arm["offline last"], by_arm["offline mean"]
    assert last["/ pooling LLM"] == RATES["offline last"] / RATES["pooling LLM last"]
    assert last["/ extract through serve"] == RATES["offline last"] / 55.0
    assert mean["/ extract through serve"] is None  # the extract phase measured no mean
    assert str(last["equals the pooling LLM"]).startswith("yes")
    assert "/ pooling LLM" not in by_arm["generate, no hidden states"]


def test_offline_vectors_that_differ_are_reported_as_not_equal(tmp_path: Path) -> None:
    saved(tmp_path, shift=0.5)
    table = offline._table(RATES, {}, tmp_path, 4)
    assert all(
        str(row["equals the pooling LLM"]).startswith("**NO**")
        for row in table.rows
        if str(row["arm"]).startswith("offline")
    )
