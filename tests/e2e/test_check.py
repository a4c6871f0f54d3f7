"""``hidden-state-proxy check`` against real deployments (issue #26): the shared stack passes;
a proxy in front of a vLLM without the hook fails with the proxy's fix. (A DP=2 stack with one
engine failed is in test_data_parallel.py, which starts it anyway; ``serve`` itself runs the
canary at every start of these stacks.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import RunningStack, proxy_process, wait_healthy
from vllm_hidden_state_proxy.check import CheckFailed, check

pytestmark = pytest.mark.e2e


def test_check_passes_on_the_shared_stack(stack: RunningStack) -> None:
    lines: list[str] = []
    with httpx.Client(base_url=stack.proxy_url, timeout=120) as client:
        deployment = check(client, None, lines.append)
    assert deployment.layers == (0, 1, 2)  # --hidden-state-layers 0,1,-1 of two layers
    assert deployment.num_hidden_layers == 2
    assert deployment.hidden_size > 0
    # the layers, hidden size and poolings come from GET /v1/hidden_states
    captured = f"captured layers (0, 1, 2); hidden size {deployment.hidden_size}; poolings last,"
    assert any(captured in line for line in lines), lines
    assert any(line.startswith("ok: vLLM 0.32") for line in lines), lines
    # The CPU runner is the V1 runner's subclass; its ring's header says so.
    assert any(line.endswith(": vLLM 0.32.0 V1 CPUModelRunner") for line in lines), lines
    assert "ok: a streamed flagged request" in lines
    assert any(line.startswith("ok: a matrix of ") for line in lines), lines
    # The command itself, as a user runs it.
    command = [sys.executable, "-m", "vllm_hidden_state_proxy.cli", "check", "--url"]
    done = subprocess.run([*command, stack.proxy_url], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"passed: {stack.proxy_url} returns hidden states"


def test_check_fails_naming_the_fix_where_vllm_has_no_hook(
    stack: RunningStack, tmp_path: Path
) -> None:
    """A proxy whose ring directory no hook publishes into: what it sees of a vLLM whose hook is
    off (``HIDDEN_STATE_PROXY_HOOK=0``) or not installed -- no ring and no note."""
    log = tmp_path / "proxy.log"
    upstream = stack.upstream_environment()  # the shared stack's vLLM wants its key
    with proxy_process(stack.vllm_url, tmp_path / "no-hook-here", log, env_overrides=upstream) as (
        url,
        process,
    ):
        wait_healthy(url + "/health", process, 30, log)
        command = [sys.executable, "-m", "vllm_hidden_state_proxy.cli", "check", "--url", url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        with httpx.Client(base_url=url, timeout=120) as client, pytest.raises(CheckFailed) as got:
            check(client, None, lambda line: None)
    assert done.returncode == 1
    [last] = done.stderr.strip().splitlines()[-1:]
    # the capture description answers as a flagged request would: 503, the proxy's fix
    assert last.startswith("FAILED: /v1/hidden_states is 503: The hidden-state worker hook is not")
    assert "install vllm-hidden-state-proxy into vLLM's Python environment" in last
    assert str(got.value) == last.removeprefix("FAILED: ")
