"""Servers the bench starts itself: the chat stack (``hidden-state-proxy serve`` on the tiny
offline model) and, later and alone, the vLLM pooling server users run today for vectors.

Each holds the machine-wide vLLM lock (:mod:`.lock`) for as long as it runs, and writes its
output to a log file in the output directory.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.options import API_KEY_ENV
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    log_tail,
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
    vllm_command,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV

SERVED_MODEL_NAME = "tiny-chat"
#: vLLM options of both servers: as the e2e tests' server (float32, eager mode: what a 2-core
#: CPU runs), with room for the sweep's 64 requests in flight in one batch.
VLLM_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "64",
    "--served-model-name",
    SERVED_MODEL_NAME,
)
#: The alternative: the same model converted to an embedding model, last-token pooling, raw
#: hidden state (no normalisation: ``use_activation`` false).
POOLER_CONFIG = {"pooling_type": "LAST", "use_activation": False}
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed", "--pooler-config")
STOP_GRACE = 60.0


@dataclass(frozen=True)
class ChatStack:
    proxy_url: str
    vllm_url: str
    model: str


@dataclass(frozen=True)
class PoolingServer:
    url: str
    model: str
    pid: int
    startup_seconds: float


def port_of(url: str) -> int | None:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return {"http": 80, "https": 443}.get(parts.scheme)


def is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


@contextlib.contextmanager
def _running(
    command: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    health_url: str,
    timeout: float,
    name: str,
    progress: Progress,
) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """Hold the vLLM lock, start ``command`` (its own session, output to ``log_path``), wait
    for ``health_url``; yield the process and its startup seconds; stop it at the end."""
    with one_vllm_at_a_time(
        on_wait=lambda: progress.say("another vLLM server runs on this machine; waiting for it")
    ):
        progress.say(f"starting {name} (log: {log_path})")
        started = time.monotonic()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            try:
                wait_until_healthy(health_url, process, timeout)
            except NotHealthy as problem:
                raise BenchError(
                    f"{name}: {problem}; last lines of {log_path}:\n{log_tail(log_path)}"
                ) from None
            startup = time.monotonic() - started
            progress.say(f"{name} is ready after {startup:.0f} s")
            yield process, startup
        finally:
            progress.say(f"stopping {name}")
            stop_process_group(process, name, grace=STOP_GRACE)


def chat_environment(api_key: str | None) -> dict[str, str]:
    """``offline_environment`` for ``serve``: the proxy's key is ``api_key`` (in the environment,
    not on the visible command line) or none, whatever the bench's own environment says."""
    env = offline_environment()
    env.pop(API_KEY_ENV, None)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return env


@contextlib.contextmanager
def chat_stack(
    model_dir: Path,
    log_dir: Path,
    timeout: float,
    progress: Progress,
    api_key: str | None = None,
) -> Iterator[ChatStack]:
    """``hidden-state-proxy serve`` on the tiny model, on two free loopback ports; with
    ``api_key`` the proxy requires it."""
    proxy_port, vllm_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "serve",
        str(model_dir),
        "--port",
        str(proxy_port),
        "--vllm-port",
        str(vllm_port),
        *VLLM_ARGS,
    ]
    stack = ChatStack(
        proxy_url=f"http://127.0.0.1:{proxy_port}",
        vllm_url=f"http://127.0.0.1:{vllm_port}",
        model=SERVED_MODEL_NAME,
    )
    with _running(
        command,
        chat_environment(api_key),
        log_dir / "serve.log",
        stack.proxy_url + "/health",
        timeout,
        "vLLM and the proxy (hidden-state-proxy serve)",
        progress,
    ):
        yield stack


@contextlib.contextmanager
def pooling_server(
    model_dir: Path, log_dir: Path, timeout: float, progress: Progress
) -> Iterator[PoolingServer]:
    """Plain vLLM (our worker hook switched off) as an embedding server with LAST pooling."""
    port = free_port()
    command = vllm_command(
        str(model_dir), port, [*VLLM_ARGS, *POOLING_ARGS, json.dumps(POOLER_CONFIG)]
    )
    env = offline_environment()
    env[HOOK_ENABLED_ENV] = "0"
    url = f"http://127.0.0.1:{port}"
    with _running(
        command,
        env,
        log_dir / "pooling-server.log",
        url + "/health",
        timeout,
        "the vLLM pooling server (--runner pooling, LAST pooling)",
        progress,
    ) as (process, startup):
        yield PoolingServer(
            url=url, model=SERVED_MODEL_NAME, pid=process.pid, startup_seconds=startup
        )
