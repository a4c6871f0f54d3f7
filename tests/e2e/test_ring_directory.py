"""``hidden-state-proxy serve`` on a ring directory vLLM's hook must not use (issue #25): another
user's, a symlink, a shared world-writable one, or one whose lock a local user holds.

The first are caught before vLLM starts (serve's pre-start check), so these start no vLLM and
end within seconds. A lock taken only once vLLM is loading is the hook's to time out: that test
starts one vLLM, which stays up for ordinary traffic until serve stops it on the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.server import STARTUP_TIMEOUT, serve_command, stack_environment
from tests.ring.helpers import NOBODY_UID, directory_lock_held, ring_dir_of
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time, stop_process_group
from vllm_hidden_state_proxy.protocol import RING_LOCK_TIMEOUT_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]

#: Seconds serve may take to refuse a directory before starting vLLM (imports included).
REFUSAL_TIMEOUT = 60.0


def _serve(
    model_dir: Path, ring_dir: Path, log_path: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            serve_command(model_dir, ring_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _wait_printed(log_path: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + REFUSAL_TIMEOUT
    while text not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{text!r} not printed; serve's output:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("foreign", f"is owned by uid {NOBODY_UID}, not by a trusted user"),
        ("symlink", "is a symbolic link"),
        ("sticky", "is a shared /tmp-like directory"),
        ("held lock", "is held by pid"),
    ],
)
def test_serve_refuses_a_ring_directory_before_starting_vllm(
    tiny_model_dir: Path, tmp_path: Path, case: str, why: str
) -> None:
    ring_dir = ring_dir_of(tmp_path, case)
    log_path = tmp_path / "serve.log"
    with directory_lock_held(ring_dir) if case == "held lock" else contextlib.nullcontext():
        process = _serve(tiny_model_dir, ring_dir, log_path, stack_environment())
        try:
            status = process.wait(REFUSAL_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve did not refuse at once:\n{log_path.read_text()[-4000:]}")
        finally:
            stop_process_group(process, "hidden-state-proxy serve", grace=60)
    output = log_path.read_text(errors="replace")
    assert status == 1, output[-4000:]
    assert f"the ring directory {ring_dir}" in output and why in output, output[-4000:]
    assert "starting vLLM" not in output


def test_a_lock_held_while_vllm_loads_is_timed_out_by_the_hook(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The hook's lock wait inside vLLM's startup is bounded: vLLM comes up (ordinary traffic
    would be served), its engine leaves a refusal naming the holder, and serve exits 1 on it."""
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir(mode=0o700)
    log_path = tmp_path / "serve.log"
    env = {**stack_environment(), RING_LOCK_TIMEOUT_ENV: "3"}
    with one_vllm_at_a_time():
        process = _serve(tiny_model_dir, ring_dir, log_path, env)
        fd = os.open(ring_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _wait_printed(log_path, "starting vLLM", process)  # past serve's own check
            fcntl.flock(fd, fcntl.LOCK_EX)  # a local user, while vLLM loads the model
            status = process.wait(STARTUP_TIMEOUT)
        finally:
            os.close(fd)
            stop_process_group(process, "hidden-state-proxy serve", grace=60)
    output = log_path.read_text(errors="replace")
    assert status == 1, output[-4000:]
    assert "vLLM is up after" in output, output[-4000:]
    assert "vLLM cannot serve what it was started with: engine 0" in output, output[-4000:]
    assert f"DirectoryLocked: the lock of the ring directory {ring_dir} was held by" in output
    if Path("/proc/locks").exists():
        assert f"held by pid {os.getpid()} for more than 3 s" in output
    assert "starting the proxy" not in output
