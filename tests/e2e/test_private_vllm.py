"""Under ``serve``'s default layout nothing but its proxy reaches vLLM (issue #25): vLLM has no
TCP port, its Unix socket lies in a 0700 directory another local user cannot enter, and without
the key serve gave it (in its environment, not its command line) vLLM refuses ``/v1``. The proxy
still serves flagged and ordinary requests, ``/health`` and ``/metrics`` over that socket.

Runs in the own-server session: the shared stack opts into ``--vllm-port`` (see server.py), so
this starts one ``serve`` in the default layout. The socket and the key are read the way a local
attacker with root would: from vLLM's command line and environment in ``/proc``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.server import SERVED_MODEL_NAME, RunningStack, run_serve
from vllm_hidden_state_proxy.processes import http_status
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, VLLM_API_KEY_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]

CHAT = "/v1/chat/completions"
NOBODY = 65534


def chat(flagged: bool, **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello there."}],
        "max_completion_tokens": 2,
        **extra,
    }
    if flagged:
        body["kv_transfer_params"] = {"return_last_hidden_state": True}
    return body


def vllm_api_server(stack: RunningStack) -> psutil.Process:
    """serve's vLLM child (the API server; its engine runs below it)."""
    found = [
        child
        for child in psutil.Process(stack.process.pid).children()
        if "vllm.entrypoints.openai.api_server" in child.cmdline()
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def private_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    work = tmp_path_factory.mktemp("private-serve")
    with run_serve(tiny_model_dir, work, private_vllm=True) as stack:
        vllm = vllm_api_server(stack)
        argv = vllm.cmdline()
        key = vllm.environ().get(VLLM_API_KEY_ENV)
        assert "--uds" in argv and key, argv
        yield dataclasses.replace(stack, vllm_uds=argv[argv.index("--uds") + 1], vllm_api_key=key)


def test_vllm_listens_on_no_tcp_port_and_its_key_is_not_on_its_command_line(
    private_stack: RunningStack,
) -> None:
    vllm = vllm_api_server(private_stack)
    argv = vllm.cmdline()
    assert "--port" not in argv and "--host" not in argv and "--api-key" not in argv
    assert private_stack.vllm_api_key is not None
    assert not any(private_stack.vllm_api_key in arg for arg in argv)
    tree = [vllm, *vllm.children(recursive=True)]
    listening = {
        connection.laddr.port
        for process in tree
        for connection in process.net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN
    }
    # Whatever TCP sockets vLLM's engine keeps for itself (torch's store), none speaks HTTP.
    for port in sorted(listening):
        assert http_status(f"http://127.0.0.1:{port}/v1/models", timeout=3) is None, port


def test_vllms_socket_is_in_a_directory_only_its_user_can_enter(
    private_stack: RunningStack,
) -> None:
    assert private_stack.vllm_uds is not None
    path = Path(private_stack.vllm_uds)
    assert stat.S_ISSOCK(path.stat().st_mode)
    directory = path.parent.stat()
    assert directory.st_uid == os.geteuid()
    assert stat.S_IMODE(directory.st_mode) == 0o700


def _connect_as(uid: int, path: str) -> int:
    """The errno of connecting to ``path`` as user ``uid`` (0: connected). A forked child
    changes user and connects: no program has to be executable for that user."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
        except OSError as error:
            code = error.errno or 255
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root")
def test_another_local_user_cannot_connect_to_vllm(private_stack: RunningStack) -> None:
    assert private_stack.vllm_uds is not None
    assert _connect_as(NOBODY, private_stack.vllm_uds) == errno.EACCES
    assert _connect_as(os.geteuid(), private_stack.vllm_uds) == 0  # the check itself works


def test_without_the_key_vllm_refuses_v1(private_stack: RunningStack) -> None:
    keyless = dataclasses.replace(private_stack, vllm_api_key=None)
    with keyless.vllm_client(timeout=60) as client:
        assert client.get("/v1/models").status_code == 401
        reserved = chat(False, vllm_xargs={REQUEST_KEY_ENTRY: "0" * 32})  # a forged entry
        assert client.post(CHAT, json=reserved).status_code == 401
        wrong = client.get("/v1/models", headers={"authorization": "Bearer guessed"})
        assert wrong.status_code == 401
    with private_stack.vllm_client(timeout=60) as client:  # the key serve gave vLLM and proxy
        assert client.get("/v1/models").status_code == 200


def test_the_proxy_still_serves_over_the_socket(private_stack: RunningStack) -> None:
    url = private_stack.proxy_url
    flagged = httpx.post(url + CHAT, json=chat(True), timeout=120)
    assert flagged.status_code == 200, flagged.text
    assert flagged.json()["kv_transfer_params"]["last_hidden_state"]
    ordinary = httpx.post(url + CHAT, json=chat(False), timeout=120)
    assert ordinary.status_code == 200, ordinary.text
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
    # The ops client reaches vLLM's own /health and /metrics over the socket too.
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=30)  # vLLM's own, then the proxy's
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
