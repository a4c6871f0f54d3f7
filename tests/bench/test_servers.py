"""What the bench starts (bench/servers.py); the instant stack runs in test_instant.py."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_hidden_state_proxy.bench import servers
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.servers import VLLM_ARGS, proxy_environment, started
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, UPSTREAM_API_KEY_ENV


def test_a_started_proxy_gets_the_benchs_key_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "stray")
    assert API_KEY_ENV not in proxy_environment(None)
    env = proxy_environment("k")
    assert env[API_KEY_ENV] == "k" and env["HF_HUB_OFFLINE"] == "1"


def test_the_chat_stacks_vllm_has_a_port_and_a_key_for_the_direct_arms(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """serve's default vLLM has no TCP port and a key only its proxy knows: the bench's stack
    opts into --vllm-port and chooses the key, out of the command line."""
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def fake_started(command: list[str], env: dict[str, str], *rest: object) -> Iterator[Any]:
        seen.update(command=command, env=env)
        yield SimpleNamespace(pid=1)

    monkeypatch.setattr(servers, "started", fake_started)
    with servers.chat_stack(tmp_path, tmp_path, 1.0, Progress(io.StringIO())) as stack:
        pass
    command = seen["command"]
    assert stack.vllm_url == f"http://127.0.0.1:{command[command.index('--vllm-port') + 1]}"
    assert stack.vllm_api_key and seen["env"][UPSTREAM_API_KEY_ENV] == stack.vllm_api_key
    assert not any(stack.vllm_api_key in arg for arg in command)
    assert stack.direct("d", "").api_key == stack.vllm_api_key


def test_vllm_runs_as_the_e2e_tests_run_it_with_room_for_the_sweep() -> None:
    assert VLLM_ARGS[VLLM_ARGS.index("--max-num-seqs") + 1] == "64"
    assert "--enforce-eager" in VLLM_ARGS


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('no such luck'); raise SystemExit(3)"]
    with pytest.raises(BenchError, match=r"exited with status 3(.|\n)*no such luck"):  # noqa: SIM117
        with started(
            command,
            {},
            tmp_path / "log",
            "http://127.0.0.1:9/health",
            30,
            "x",
            Progress(io.StringIO()),
        ):
            pass
