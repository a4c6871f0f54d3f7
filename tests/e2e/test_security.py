"""Security properties of the running stack: vLLM on loopback only, nothing private in logs."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.e2e.server import RunningStack


def non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses other than 127.0.0.0/8."""
    found: set[str] = set()
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        found.update(a for a in out.split() if "." in a)
    except (OSError, subprocess.SubprocessError):
        pass
    with contextlib.suppress(OSError):
        found.update(
            str(info[4][0])
            for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        )
    return sorted(a for a in found if not a.startswith("127."))


def test_vllm_is_not_reachable_on_a_non_loopback_address(stack: RunningStack) -> None:
    port = urlparse(stack.vllm_url).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # it does listen, on loopback
    addresses = non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for address in addresses:
        with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
            pass


def test_vllm_wants_the_key_serve_gave_it_and_its_command_line_does_not_show_it(
    stack: RunningStack,
) -> None:
    """The shared stack's vLLM is on loopback TCP (--vllm-port) with a key the tests chose;
    serve's default (a private socket) is tested in test_private_vllm.py."""
    assert stack.vllm_api_key is not None
    assert httpx.get(stack.vllm_url + "/v1/models", timeout=30).status_code == 401
    guessed = {"authorization": "Bearer guessed"}
    assert httpx.get(stack.vllm_url + "/v1/models", headers=guessed, timeout=30).status_code == 401
    keyed = httpx.get(stack.vllm_url + "/v1/models", headers=stack.vllm_headers, timeout=30)
    assert keyed.status_code == 200
    for process in psutil.Process(stack.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            assert not any(stack.vllm_api_key in arg for arg in process.cmdline()), process


def test_logs_contain_no_prompts_or_vectors_at_the_default_level(
    stack: RunningStack, client: Any, model_name: str
) -> None:
    secret = "zebra-quartz-7431 private prompt text"
    response = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": secret}],
        max_completion_tokens=2,
        extra_body={"kv_transfer_params": {"return_last_hidden_state": True}},
    )
    vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
    client.embeddings.create(model=model_name, input=secret)
    log = stack.log_path.read_text(errors="replace")
    assert "zebra-quartz" not in log
    for value in vector[:8]:
        assert repr(value) not in log and f"{value:.6f}" not in log
