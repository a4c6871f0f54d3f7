"""docs/offline.md's first example, run as written (the model replaced by the tiny one) in an
interpreter of its own: a script that creates its own ``LLM`` (its ``__main__`` guard
included) and gets its texts and vectors. Its own vLLM, under the machine-wide lock: the
own-server session, apart from test_offline.py's (whose fixture holds the lock meanwhile).
The corpus example uses the same calls as test_offline.py's corpus test."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import STARTUP_TIMEOUT, stack_environment
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time
from vllm_hidden_state_proxy.protocol import RING_DIR_ENV

pytestmark = pytest.mark.own_server

ROOT = Path(__file__).resolve().parents[2]
DOC_MODEL = "Qwen/Qwen3-0.6B"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_NUMBER = r"\s*([-+0-9.eE]+)\s*"
_MATRIX = re.compile(rf"\[\[(?P<a>{_NUMBER}){_NUMBER}\]\s*\n\s*\[{_NUMBER}(?P<d>{_NUMBER})\]\]")


def test_the_first_example_runs_as_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    code = _BLOCK.findall((ROOT / "docs" / "offline.md").read_text())[0]
    assert DOC_MODEL in code and 'if __name__ == "__main__":' in code
    script = tmp_path / "example.py"
    code = code.replace(DOC_MODEL, str(tiny_model_dir))
    script.write_text(code.replace("max_model_len=4096", "max_model_len=1024"))
    ring_dir = Path("/dev/shm") / f"hsp-offline-docs-{tmp_path.name}"
    env = {**stack_environment("v1"), RING_DIR_ENV: str(ring_dir)}
    try:
        with one_vllm_at_a_time():
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
                check=False,
            )  # fmt: skip
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.endswith(("(128,)", "]"))]
    assert any(line.endswith("(128,)") for line in printed), done.stdout[-2000:]
    # The unit-length vectors' dot products, as numpy prints a 2x2 matrix: 1 on the diagonal
    # (to float32 rounding: 0.99999994 or 1.0000001 on some CPUs' kernels).
    matrix = _MATRIX.search(done.stdout)
    assert matrix is not None, done.stdout[-2000:]
    diagonal = [float(matrix["a"]), float(matrix["d"])]
    assert all(abs(value - 1.0) <= 1e-5 for value in diagonal), matrix[0]
