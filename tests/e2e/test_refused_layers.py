"""A server started with layers its model cannot return fails at startup, naming the model class
(issue #14): vLLM itself would serve on (the worker hook never fails vLLM), ``serve`` does not.

The model is the image fixture (``tests/e2e/tiny_vlm.py``): vLLM's
``Idefics3ForConditionalGeneration`` does not implement ``SupportsEagle3``, so it can give the
final layer only. Runs in the own-server session: it starts its own vLLM.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import STARTUP_TIMEOUT, serve_command, stack_environment
from tests.e2e.tiny_vlm import build_tiny_vlm
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time, stop_process_group

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]


def test_serve_refuses_layers_the_model_cannot_return(tmp_path: Path) -> None:
    model_dir = build_tiny_vlm(tmp_path / "tiny-vlm")
    log_path = tmp_path / "serve.log"
    command = serve_command(model_dir, tmp_path / "rings", ["--hidden-state-layers", "1"])
    with one_vllm_at_a_time(), open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=stack_environment(),
            start_new_session=True,
        )
        try:
            status = process.wait(STARTUP_TIMEOUT)
        finally:
            stop_process_group(process, "hidden-state-proxy serve", grace=60)
    output = log_path.read_text(errors="replace")
    assert status == 1, output[-4000:]
    assert "vLLM cannot serve what it was started with: engine 0" in output, output[-4000:]
    assert (
        "Idefics3ForConditionalGeneration does not support auxiliary hidden-state outputs" in output
    )
    assert "starting the proxy" not in output and "ready:" not in output
