"""A real proxy process misconfigured against the real vLLM: clear 503/502, never a bare 200."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_hidden_state_proxy.serve import stop_process_group

from .server import RunningStack, free_port, wait_healthy

CHAT = "/v1/chat/completions"


@contextlib.contextmanager
def proxy_process(
    upstream: str, ring_dir: Path, log: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "proxy",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--ring-dir",
        str(ring_dir),
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        stop_process_group(process, "proxy", grace=10)


def chat(model: str, flagged: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 1,
    }
    if flagged:
        body["kv_transfer_params"] = {"return_last_hidden_state": True}
    return body


def wait_listening(url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            httpx.get(url + "/v1/models", timeout=2)
            return
        time.sleep(0.2)
    pytest.fail(f"proxy did not start: {log.read_text(errors='replace')[-2000:]}")


def test_a_ring_directory_without_the_hooks_ring_is_a_503_that_says_how_to_fix_it(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    empty = tmp_path / "not-the-ring"
    log = tmp_path / "proxy.log"
    with proxy_process(stack.vllm_url, empty, log) as (url, process):
        # vLLM is healthy, so this proxy is too: only the flagged path depends on the ring.
        wait_healthy(url + "/health", process, 30, log)
        flagged = httpx.post(url + CHAT, json=chat(model_name, True), timeout=30)
        ordinary = httpx.post(url + CHAT, json=chat(model_name, False), timeout=30)
    assert flagged.status_code == 503
    error = flagged.json()["error"]
    assert "worker hook is not active" in error["message"]
    assert str(empty) in error["message"]
    assert ordinary.status_code == 200
    assert ordinary.json().get("kv_transfer_params") is None


def test_vllm_unreachable_is_a_502_and_health_turns_503(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    log = tmp_path / "proxy.log"
    with proxy_process(dead, stack.ring_dir, log) as (url, _):
        wait_listening(url, log)
        health = httpx.get(url + "/health", timeout=10)
        flagged = httpx.post(url + CHAT, json=chat(model_name, True), timeout=30)
        ordinary = httpx.post(url + CHAT, json=chat(model_name, False), timeout=30)
    assert health.status_code == 503
    for response in (flagged, ordinary):
        assert response.status_code == 502, response.text
        assert dead in response.json()["error"]["message"]
