"""What the compose test and the Helm pod test check inside their containers, written once: the
flag, the ring's documented permissions, the snippets run with ``docker exec`` (ring modes, the
engine's kill) and the Transformers vector a request must get."""

from __future__ import annotations

import signal
import stat
from typing import Any

from tests.e2e.reference import Reference

FLAG: dict[str, Any] = {
    "chat_template_kwargs": {"enable_thinking": False},
    "kv_transfer_params": {"return_last_hidden_state": True},
}
#: The proxy's user and the ring volume's group (proxy.Dockerfile, compose.yaml, the Helm chart).
PROXY_UID = PROXY_GID = 10001
#: What docs/deploy.md promises for the ring: drwxrws--- and -rw-r-----, root:10001.
RING_DIR_MODE = stat.S_ISGID | 0o770
RING_FILE_MODE = 0o640
RING_DIR = "/run/vllm-hidden-states"
#: vLLM's engine process names itself so (setproctitle; /proc/PID/comm keeps 15 characters).
ENGINE_TITLE = "VLLM::EngineCor"

#: ``python3 -c`` inside a container: {path: [mode, uid, gid, is_dir]} of the ring directory
#: and its ring files.
RING_STAT = f"""
import glob, json, os
def describe(path):
    s = os.stat(path)
    return [s.st_mode & 0o7777, s.st_uid, s.st_gid, os.path.isdir(path)]
print(json.dumps({{p: describe(p) for p in ["{RING_DIR}", *glob.glob("{RING_DIR}/ring-*.bin")]}}))
"""

#: ``python3 -c`` inside vLLM's container: SIGKILL its engine process (as the OOM killer would);
#: prints the pids killed.
KILL_ENGINE = f"""
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        comm = open(f"/proc/{{pid}}/comm").read().strip()
    except OSError:
        continue
    if comm == "{ENGINE_TITLE}":
        os.kill(int(pid), {int(signal.SIGKILL)})
        print(pid)
"""


def expected_vector(reference: Reference, text: str) -> list[float]:
    """Transformers' last hidden state for ``text`` as a one-message chat, thinking off."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    return reference.last_hidden_state(ids)
