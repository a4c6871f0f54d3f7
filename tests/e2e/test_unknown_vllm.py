"""Real vLLM pretending to be a release the hook does not know (issue #26): version 0.99.0, with
V1's ``ExecuteModelState.hidden_states`` renamed. The hook must not run blind, nor switch itself
off silently: the engine's failure note names the version and the missing piece, and the proxy
answers flagged requests and ``/health`` with that text (not its generic "no ring" one), while
ordinary traffic flows.

The pretence is a ``sitecustomize`` on the vLLM process's ``PYTHONPATH``: it rewrites two vLLM
modules as they are imported, in every process vLLM starts. vLLM itself still works (it builds
and unpacks that named tuple by position). Runs in the own-server session: one vLLM start.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import (
    SERVED_MODEL_NAME,
    STARTUP_TIMEOUT,
    TEST_VLLM_ARGS,
    proxy_process,
    stack_environment,
    wait_answering,
    wait_healthy,
)
from vllm_hidden_state_proxy.processes import (
    free_port,
    one_vllm_at_a_time,
    stop_process_group,
    vllm_command,
)
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, RING_DIR_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]

PRETENDED = "0.99.0"

SITECUSTOMIZE = f'''
"""Test only: make this vLLM look like release {PRETENDED} whose V1 runner renamed a field."""
import collections
import importlib.machinery

_find_spec = importlib.machinery.PathFinder.find_spec


def _pretend_version(module):
    module.__version__ = "{PRETENDED}"


def _rename_state_field(module):
    fields = [
        "final_hidden_states" if name == "hidden_states" else name
        for name in module.ExecuteModelState._fields
    ]
    module.ExecuteModelState = collections.namedtuple("ExecuteModelState", fields)


_AFTER = {{
    "vllm.version": _pretend_version,
    "vllm.v1.worker.gpu_model_runner": _rename_state_field,
}}


class _Then:
    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.after(module)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def find_spec(fullname, path=None, target=None):
    spec = _find_spec(fullname, path, target)
    if spec is not None and spec.loader is not None and fullname in _AFTER:
        spec.loader = _Then(spec.loader, _AFTER[fullname])
    return spec


importlib.machinery.PathFinder.find_spec = find_spec
'''


@pytest.fixture
def pretending_vllm(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """vLLM (vLLM URL, ring directory, log) as release 0.99.0, until the test ends."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    ring_dir = tmp_path / "rings"
    log = tmp_path / "vllm.log"
    env = stack_environment()
    env[RING_DIR_ENV] = str(ring_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    port = free_port()
    command = vllm_command(str(tiny_model_dir), port, TEST_VLLM_ARGS)
    with one_vllm_at_a_time(), open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url + "/health", process, STARTUP_TIMEOUT, log)
            yield url, ring_dir, log
        finally:
            stop_process_group(process, "vLLM", grace=30)


def chat(flagged: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 1,
    }
    if flagged:
        body["kv_transfer_params"] = {"return_last_hidden_state": True}
    return body


def test_an_unknown_vllm_with_a_renamed_internal_is_named_by_health_and_flagged_requests(
    pretending_vllm: tuple[str, Path, Path], tmp_path: Path
) -> None:
    vllm_url, ring_dir, vllm_log = pretending_vllm
    proxy_log = tmp_path / "proxy.log"
    key = {"authorization": "Bearer k"}
    with proxy_process(vllm_url, ring_dir, proxy_log, env_overrides={API_KEY_ENV: "k"}) as (
        url,
        process,
    ):
        wait_answering(url + "/health", process, proxy_log)
        health = httpx.get(url + "/health", headers=key, timeout=30)
        words = httpx.get(url + "/health", timeout=30)  # without the key: in words only
        flagged = httpx.post(url + "/v1/chat/completions", json=chat(True), headers=key, timeout=60)
        ordinary = httpx.post(
            url + "/v1/chat/completions", json=chat(False), headers=key, timeout=60
        )
        version = httpx.get(url + "/version", headers=key, timeout=30)
    logs = vllm_log.read_text(errors="replace")
    assert version.json()["version"] == PRETENDED, "the pretence did not take"
    expected = (
        "ExecuteModelState (V1) has no field hidden_states",
        f"vLLM {PRETENDED} (untested by this hook)",
    )
    assert health.status_code == 503, (health.text, logs[-6000:])
    message = health.json()["error"]["message"]
    assert "is healthy, but engine 0" in message, message
    for part in expected:
        assert part in message, (message, logs)
    assert words.status_code == 503
    assert "cannot run there until vLLM is restarted" in words.json()["error"]["message"]
    assert PRETENDED not in words.text
    assert flagged.status_code == 503, flagged.text
    flagged_message = flagged.json()["error"]["message"]
    for part in expected:
        assert part in flagged_message, flagged_message
    assert "worker hook is not active" not in flagged_message
    assert ordinary.status_code == 200, ordinary.text
    assert "ExecuteModelState (V1) has no field hidden_states" in logs  # one line in vLLM's log
