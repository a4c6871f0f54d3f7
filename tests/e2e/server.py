"""Start the real stack for end-to-end tests: ``hidden-state-proxy serve`` on the tiny model."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    http_status,
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
    wait_until_healthy,
)

#: vLLM options used by the shared test server (small batches force chunked prefill).
MAX_NUM_BATCHED_TOKENS = 128
MAX_MODEL_LEN = 1024
TEST_VLLM_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-batched-tokens",
    str(MAX_NUM_BATCHED_TOKENS),
    "--max-num-seqs",
    "32",
    "--enable-prefix-caching",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--served-model-name",
    "tiny-chat",
]
SERVED_MODEL_NAME = "tiny-chat"
#: The layers the shared stack captures (``serve --hidden-state-layers``): the embeddings, the
#: first decoder layer's output and the final layer of the two-layer tiny model.
SHARED_LAYERS = ("0", "1", "-1")
#: The proxy's request size limit in the shared test stack (413 above it).
MAX_BODY_SIZE = 4 * 1024 * 1024
STARTUP_TIMEOUT = 420.0


@dataclass
class RunningStack:
    proxy_url: str
    vllm_url: str
    ring_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    try:
        wait_until_healthy(url, process, timeout)
    except NotHealthy as problem:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:])
        raise RuntimeError(f"{problem}; last lines of {log}:\n{tail}") from None


def wait_answering(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``url`` answers at all (whatever the status)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while http_status(url) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:])
            raise RuntimeError(f"{url} never answered; last lines of {log}:\n{tail}")
        time.sleep(0.5)


def stack_environment() -> dict[str, str]:
    env = offline_environment()
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


def serve_command(
    model_dir: Path,
    ring_dir: Path,
    extra_args: Sequence[str] = (),
    proxy_port: int | None = None,
    vllm_port: int | None = None,
) -> list[str]:
    """``hidden-state-proxy serve`` on ``model_dir`` with the test stack's vLLM options."""
    return [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "serve",
        str(model_dir),
        "--port",
        str(proxy_port or free_port()),
        "--vllm-port",
        str(vllm_port or free_port()),
        "--ring-dir",
        str(ring_dir),
        "--max-body-size",
        str(MAX_BODY_SIZE),
        *TEST_VLLM_ARGS,
        *extra_args,
    ]


@contextlib.contextmanager
def run_serve(
    model_dir: Path,
    work_dir: Path,
    extra_args: Sequence[str] = (),
    env_overrides: dict[str, str] | None = None,
    *,
    ring_dir: Path | None = None,
    locked: bool = True,
    require_ready: bool = True,
) -> Iterator[RunningStack]:
    """Run ``hidden-state-proxy serve`` until the block ends (SIGTERM, then SIGKILL).

    Holds the machine-wide vLLM lock unless ``locked`` is false (the caller holds it, to run
    two servers side by side). ``ring_dir``: a ring directory of the caller's, kept at the end.
    ``require_ready``: wait for the proxy's /health to be 200; otherwise only for vLLM's
    (a stack whose proxy reports a problem).
    """
    with one_vllm_at_a_time() if locked else contextlib.nullcontext():
        yield from _run_serve(
            model_dir, work_dir, extra_args, env_overrides, ring_dir, require_ready
        )


def _run_serve(
    model_dir: Path,
    work_dir: Path,
    extra_args: Sequence[str],
    env_overrides: dict[str, str] | None,
    shared_ring_dir: Path | None,
    require_ready: bool,
) -> Iterator[RunningStack]:
    proxy_port, vllm_port = free_port(), free_port()
    ring_dir = shared_ring_dir or Path("/dev/shm") / f"hsp-test-{os.getpid()}-{vllm_port}"
    log_path = work_dir / f"serve-{vllm_port}.log"
    command = serve_command(model_dir, ring_dir, extra_args, proxy_port, vllm_port)
    env = stack_environment()
    env.update(env_overrides or {})
    shm_before = _vllm_shm_segments()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    stack = RunningStack(
        proxy_url=f"http://127.0.0.1:{proxy_port}",
        vllm_url=f"http://127.0.0.1:{vllm_port}",
        ring_dir=ring_dir,
        log_path=log_path,
        process=process,
    )
    try:
        if require_ready:
            wait_healthy(stack.proxy_url + "/health", process, STARTUP_TIMEOUT, log_path)
        else:
            wait_healthy(stack.vllm_url + "/health", process, STARTUP_TIMEOUT, log_path)
            wait_answering(stack.proxy_url + "/health", process, log_path)
        yield stack
    finally:
        stop_process_group(process, "hidden-state-proxy serve", grace=60)
        if shared_ring_dir is None:
            shutil.rmtree(ring_dir, ignore_errors=True)
        # vLLM CPU with tensor parallelism leaves its shared-memory segments behind.
        for leftover in _vllm_shm_segments() - shm_before:
            with contextlib.suppress(OSError):
                leftover.unlink()


def _vllm_shm_segments() -> set[Path]:
    shm = Path("/dev/shm")
    return set(shm.glob("vllm_dist_*")) if shm.is_dir() else set()


@contextlib.contextmanager
def proxy_process(
    upstream: str,
    ring_dir: Path,
    log: Path,
    extra_args: Sequence[str] = (),
    env_overrides: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``hidden-state-proxy proxy`` process (no vLLM of its own) until the block ends."""
    port = port or free_port()
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
        *extra_args,
    ]
    env = {**os.environ, **(env_overrides or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        stop_process_group(process, "proxy", grace=10)
