"""Security properties of the running stack: vLLM on loopback only, nothing private in logs."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from typing import Any
from urllib.parse import urlparse

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
