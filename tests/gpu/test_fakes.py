"""The folder's own tools: its fakes against vLLM's classes, and the GPU check's script on CPU.

The fakes (``batch.py``) carry vLLM's field names without importing vLLM (the CUDA machines have
none); where vLLM is installed (CI, the dev venv) these names are checked against its own
classes, and the fake runner passes the hook's own startup check of a V2 runner. The script
(``run.py``) runs here on CPU with tiny sizes, as it runs on a CUDA machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from tests.gpu import run
from tests.gpu.batch import (
    FakeExecuteModelState,
    FakeInputBatch,
    FakeNewRequestData,
    FakeSamplingParams,
    FakeSchedulerOutput,
    FakeV2Runner,
)
from tests.gpu.devices import CUDA_MISSING
from tests.gpu.model import MatmulModel

ROOT = Path(__file__).resolve().parents[2]


def names(cls: type) -> list[str]:
    return [field.name for field in fields(cls)]  # type: ignore[arg-type]


def test_the_fakes_carry_vllms_own_field_names() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: nothing to check the fakes against")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    from vllm_hidden_state_proxy.worker_hook.compat import missing_fields
    from vllm_hidden_state_proxy.worker_hook.runners import V2RunnerView

    for fake, real in (
        (FakeSchedulerOutput, SchedulerOutput),
        (FakeNewRequestData, NewRequestData),
        (FakeInputBatch, InputBatch),
        (FakeExecuteModelState, ExecuteModelState),
    ):
        assert missing_fields(real, names(fake)) == [], fake.__name__
    params = SamplingParams(max_tokens=3, extra_args={"a": 1})
    for name in names(FakeSamplingParams):
        assert hasattr(params, name), name
    model = MatmulModel(torch.device("cpu"), tokens=4, hidden=8)
    V2RunnerView().check(FakeV2Runner(model))


def test_the_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    command = ["tests/gpu/run.py", "--device", "cpu", "--smoke", "--skip-tests", "--json"]
    done = subprocess.run(
        [sys.executable, *command, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "== vllm-hidden-state-proxy GPU check (issue #49) =="
    assert lines[1].startswith("date ") and " | device CPU " in lines[1]
    assert any(line.startswith(" hidden  pooling  flagged  forward ms") for line in lines)
    assert any(line.startswith(" path ") for line in lines)
    assert lines[-1].startswith("[gpu-check] PASS in ")
    results = json.loads(out.read_text())
    assert results["verdict"] == "PASS"
    rows = results["figures"]["steps"]
    assert {(r["hidden"], r["pooling"], r["flagged"]) for r in rows} == {
        (h, p, f) for h in (64, 128) for p in ("last", "mean") for f in (1, 4, 16)
    }
    assert [c["path"] for c in results["figures"]["copies"]] == [
        "SyncRowCopier (CPU)",
        ".cpu() into pageable",
        "record: copier + ring write",
    ]


def test_the_script_names_the_wheels_it_misses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(run.NEEDED, "not_a_module_49", "not-a-package")
    assert run.main(["--skip-tests"]) == 3
    said = capsys.readouterr().out
    assert "missing: not-a-package" in said
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in said
    assert "not-a-package" in said.splitlines()[1]


@pytest.mark.skipif(CUDA_MISSING is None, reason="a CUDA device is here: the script would run")
def test_without_cuda_the_script_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main([]) == 2
    assert capsys.readouterr().out.startswith("[gpu-check] no CUDA device")
