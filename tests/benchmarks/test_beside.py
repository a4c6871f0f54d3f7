"""The beside check (benchmarks/beside.py), against fake servers: ordinary bursts with one flagged
client of each kind running beside them, arms interleaved."""

from __future__ import annotations

import io

import anyio
from benchmarks.beside import FLAGGED_TOKENS, KINDS, measure_beside

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.progress import Progress


def test_each_kind_runs_beside_an_ordinary_burst() -> None:
    fake = FakeServers()
    table = anyio.run(measure_beside, fake.stack("key"), 2, 4, Progress(io.StringIO()))
    assert [row["flagged kind beside"] for row in table.rows] == list(KINDS)
    assert table.get("none", "ordinary / none") == 1.0
    assert table.get("none", "flagged requests beside") == 0
    documents = [document for _, _, document in fake.seen]
    ordinary = [d for d in documents if "kv_transfer_params" not in d]
    flagged = [d["kv_transfer_params"] for d in documents if "kv_transfer_params" in d]
    assert len(ordinary) >= 2 * 4 * len(KINDS)  # every turn's burst, besides the warm-ups
    assert all(d["max_tokens"] == 1 for d in ordinary)
    kinds = {kv.get("last_hidden_state_pooling", "last") for kv in flagged}
    assert kinds == {"last", "last_answer", "all_prompt", "all_answer", "mean"}
    assert any("last_hidden_state_spans" in kv for kv in flagged)
    flagged_documents = [d for d in documents if "kv_transfer_params" in d]
    assert {d["max_tokens"] for d in flagged_documents} == {FLAGGED_TOKENS}
