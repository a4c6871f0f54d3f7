"""``hidden-state-proxy bench --phases offline --smoke``: the offline API against vLLM's offline
pooling runner (issue #47), three real ``LLM`` processes on the tiny model; no timing
thresholds, only that every arm measured and the offline vectors equal the pooling runner's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.bench.offline import ARMS
from vllm_hidden_state_proxy.cli import main

pytestmark = pytest.mark.own_server


def test_the_offline_phase_measures_every_arm_and_its_vectors_agree(tmp_path: Path) -> None:
    argv = ["bench", "--smoke", "--phases", "offline", "--output-dir", str(tmp_path)]
    assert main([*argv, "--extract-inputs", "24"]) == 0, (tmp_path / "bench.md").read_text()
    table = json.loads((tmp_path / "bench.json").read_text())["tables"]["offline"]
    rows = {row["arm"]: row for row in table["rows"]}
    assert list(rows) == list(ARMS)
    for arm, row in rows.items():
        assert row["prompts/s"] > 0, row
        if arm.startswith("offline"):
            assert row["/ pooling LLM"] > 0 and row["/ extract through serve"] is None, row
            assert row["equals the pooling LLM"].startswith("yes"), row
    assert "## Offline: hidden states" in (tmp_path / "bench.md").read_text()
