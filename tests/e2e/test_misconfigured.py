"""A real proxy process misconfigured against the real vLLM: clear 503/502, never a bare 200."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import RunningStack, proxy_process, wait_healthy
from vllm_hidden_state_proxy.processes import NotHealthy, free_port, wait_until_healthy

CHAT = "/v1/chat/completions"


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
    """Until the proxy answers at all (its vLLM may be unreachable: any status will do)."""
    try:
        wait_until_healthy(url + "/v1/models", None, 30, status=None, interval=0.2)
    except NotHealthy:
        pytest.fail(f"proxy did not start: {log.read_text(errors='replace')[-2000:]}")


def test_a_ring_directory_without_the_hooks_ring_is_a_503_that_says_how_to_fix_it(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    empty = tmp_path / "not-the-ring"
    log = tmp_path / "proxy.log"
    upstream = stack.upstream_environment()
    with proxy_process(stack.vllm_url, empty, log, env_overrides=upstream) as (url, process):
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
    assert health.json()["error"]["message"] == "vLLM is not healthy: it cannot be reached."
    for response in (flagged, ordinary):
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        # Any client sees it: in words; vLLM's address and the exception are the operator's.
        assert message.startswith("Could not reach vLLM") and dead not in message
    assert dead in log.read_text(errors="replace")


def _garbage_rings(directory: Path) -> dict[str, bytes]:
    """Ring files a proxy must refuse: wrong magic, truncated, unknown layout version."""
    from vllm_hidden_state_proxy.ring.layout import FIXED_HEADER_SIZE, MAGIC

    directory.mkdir(mode=0o700)
    files = {
        "ring-00000000000000aa-dp0.bin": b"NOTARING" + bytes(4096),
        "ring-00000000000000aa-dp1.bin": MAGIC + bytes(10),  # truncated header
        "ring-00000000000000aa-dp2.bin": MAGIC
        + (999).to_bytes(4, "little")
        + bytes(FIXED_HEADER_SIZE + 4096),
    }
    for name, content in files.items():
        (directory / name).write_bytes(content)
        (directory / name).chmod(0o600)
    return files


def test_corrupt_ring_files_are_refused_with_a_log_line_and_a_503(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    import fcntl

    rings = tmp_path / "rings"
    files = _garbage_rings(rings)
    log = tmp_path / "proxy.log"
    # A "live" writer (the lock held) does not make a corrupt file acceptable.
    with open(rings / "ring-00000000000000aa-dp0.bin", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        upstream = stack.upstream_environment()
        with proxy_process(stack.vllm_url, rings, log, env_overrides=upstream) as (url, process):
            wait_healthy(url + "/health", process, 30, log)
            responses = [httpx.post(url + CHAT, json=chat(model_name, True), timeout=30)]
            responses.append(httpx.post(url + CHAT, json=chat(model_name, True), timeout=30))
            ordinary = httpx.post(url + CHAT, json=chat(model_name, False), timeout=30)
            assert process.poll() is None, "the proxy must not crash"
    for response in responses:
        assert response.status_code == 503, response.text
    assert ordinary.status_code == 200
    text = log.read_text(errors="replace")
    for name in files:
        assert name in text, f"no log line about {name}:\n{text[-3000:]}"


def test_api_key_guards_the_proxy_and_health_stays_open(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    log = tmp_path / "proxy.log"
    key = "e2e-proxy-key"
    env = {"HIDDEN_STATE_PROXY_API_KEY": key, **stack.upstream_environment()}
    with proxy_process(stack.vllm_url, stack.ring_dir, log, env_overrides=env) as (url, process):
        wait_healthy(url + "/health", process, 30, log)
        denied = httpx.post(url + CHAT, json=chat(model_name, True), timeout=30)
        wrong = httpx.post(
            url + CHAT,
            json=chat(model_name, True),
            headers={"authorization": "Bearer nope"},
            timeout=30,
        )
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        response = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hello"}],
            max_completion_tokens=1,
            extra_body={"kv_transfer_params": {"return_last_hidden_state": True}},
        )
        metrics = httpx.get(url + "/metrics", timeout=30)
    for refused in (denied, wrong):
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
    assert len(response.model_dump()["kv_transfer_params"]["last_hidden_state"]) > 0
    assert metrics.status_code == 200
    assert key not in log.read_text(errors="replace")
