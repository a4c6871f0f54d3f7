"""Servers the bench starts itself, each writing its output to a log in the output directory:
the chat stack (:func:`chat_stack`: ``hidden-state-proxy serve`` on the tiny offline model),
any other through :func:`started`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_hidden_state_proxy import processes
from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.processes import NotHealthy, free_port, offline_environment
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, UPSTREAM_API_KEY_ENV

SERVED_MODEL_NAME = "tiny-chat"
#: As the e2e tests' server (float32, eager mode: what a 2-core CPU runs), with room for the
#: sweep's 64 requests in flight in one batch.
VLLM_ARGS = (
    *("--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"),
    *("--max-num-seqs", "64", "--served-model-name", SERVED_MODEL_NAME),
)
STOP_GRACE = 60.0
CLI = (sys.executable, "-m", "vllm_hidden_state_proxy.cli")


@contextlib.contextmanager
def started(
    command: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    health_url: str,
    timeout: float,
    name: str,
    progress: Progress,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``command`` (its own session, output to ``log_path``), wait for ``health_url``,
    yield the process, stop it at the end."""
    progress.say(f"starting {name} (log: {log_path})")
    started_at = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        try:
            processes.wait_until_healthy(health_url, process, timeout)
        except NotHealthy as problem:
            tail = processes.log_tail(log_path)
            raise BenchError(f"{name}: {problem}; last lines of {log_path}:\n{tail}") from None
        progress.say(f"{name} is ready after {time.monotonic() - started_at:.0f} s")
        yield process
    finally:
        progress.say(f"stopping {name}")
        processes.stop_process_group(process, name, grace=STOP_GRACE)


def proxy_environment(api_key: str | None) -> dict[str, str]:
    """``offline_environment`` for a proxy the bench starts: its key is ``api_key`` (in the
    environment, not on the visible command line) or none, whatever the bench's own says."""
    env = offline_environment()
    env.pop(API_KEY_ENV, None)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return env


def vllm_lock(progress: Progress) -> contextlib.AbstractContextManager[None]:
    """The machine-wide lock, held while the bench's vLLM servers run."""
    return processes.one_vllm_at_a_time(
        on_wait=lambda: progress.say("another vLLM server runs on this machine; waiting for it")
    )


@contextlib.contextmanager
def chat_stack(
    model_dir: Path,
    log_dir: Path,
    timeout: float,
    progress: Progress,
    api_key: str | None = None,
    *,
    serve_args: Sequence[str] = (),
    name: str = "serve",
) -> Iterator[ChatStack]:
    """``hidden-state-proxy serve`` on the tiny model, on two free loopback ports; with
    ``api_key`` the proxy requires it. The direct arms measure vLLM over TCP as the proxy's arms
    do, so vLLM gets serve's opt-in ``--vllm-port`` and a key the bench chooses (serve's
    default is a private socket and a key nobody else knows). The caller holds
    :func:`vllm_lock`."""
    proxy_port, vllm_port = free_port(), free_port()
    command = [*CLI, "serve", str(model_dir), "--port", str(proxy_port)]
    command += ["--vllm-port", str(vllm_port), *VLLM_ARGS, *serve_args]
    proxy_url, vllm_url = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{vllm_port}"
    vllm_key = secrets.token_urlsafe(24)
    stack = ChatStack(proxy_url, vllm_url, SERVED_MODEL_NAME, api_key, vllm_api_key=vllm_key)
    environment = {**proxy_environment(api_key), UPSTREAM_API_KEY_ENV: vllm_key}
    log, health = log_dir / f"{name}.log", stack.proxy_url + "/health"
    title = f"vLLM and the proxy ({name}: hidden-state-proxy serve {' '.join(serve_args)})"
    with started(command, environment, log, health, timeout, title, progress) as process:
        yield dataclasses.replace(stack, pid=process.pid)
