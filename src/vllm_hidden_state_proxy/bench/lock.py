"""The machine-wide "one vLLM server at a time" lock, shared with the test sessions.

Whoever starts a vLLM server on this machine holds an exclusive ``flock`` on
``VLLM_LOCK_PATH`` for as long as that server runs (the e2e fixtures do the same; from a shell:
``flock /tmp/vllm-hidden-state-proxy-vllm.lock <command>``). The kernel drops the lock when the
holder exits, whatever the way.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path

VLLM_LOCK_PATH = Path("/tmp/vllm-hidden-state-proxy-vllm.lock")


@contextlib.contextmanager
def one_vllm_at_a_time(
    on_wait: Callable[[], None] | None = None, path: Path = VLLM_LOCK_PATH
) -> Iterator[None]:
    """Hold the lock for the block; ``on_wait`` is called once if another holder makes us wait."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
