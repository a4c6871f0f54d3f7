"""The instant stack (issue #15): the instant upstream (a bare uvicorn app, no vLLM:
:mod:`benchmarks.instant_upstream`) and ``hidden-state-proxy proxy`` processes in front of it,
sharing a fresh ring directory, each writing its output to a log in the output directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.servers import CLI, proxy_environment, started
from vllm_hidden_state_proxy.bench.usage import tree_cpu_seconds
from vllm_hidden_state_proxy.processes import free_port

#: Run as a script (not ``-m``): it needs nothing of this folder, only the package.
UPSTREAM = str(Path(__file__).with_name("instant_upstream.py"))


class Server(NamedTuple):
    """A server the hop check sends to: a label, its URL, its process."""

    label: str
    url: str
    pid: int

    def cpu(self) -> float:
        """CPU seconds of the server's process tree so far (all its workers)."""
        return tree_cpu_seconds(self.pid)


@dataclass(frozen=True)
class InstantStack:
    #: The instant upstream itself, labelled "app".
    app: Server
    proxies: tuple[Server, ...]


#: Where the instant upstream also listens, on a Unix domain socket (in its ring directory).
UDS_NAME = "upstream.sock"


class InstantProxy(NamedTuple):
    """A proxy of the hop check: its label, and more options of ``hidden-state-proxy proxy``."""

    label: str
    args: tuple[str, ...] = ()


#: The proxies the hop check compares, side by side in front of one instant upstream: the
#: default (its own HTTP/1.1 engine), on aiohttp's client, the default over a Unix domain socket
#: ({uds} is replaced), and with two worker processes.
INSTANT_PROXIES: tuple[InstantProxy, ...] = (
    InstantProxy("http1"),
    InstantProxy("aiohttp", ("--upstream-client", "aiohttp")),
    InstantProxy("uds", ("--upstream-uds", "{uds}")),
    InstantProxy("2 workers", ("--workers", "2")),
)


@contextlib.contextmanager
def instant_stack(
    log_dir: Path,
    progress: Progress,
    proxies: Sequence[tuple[str, Sequence[str]]] = INSTANT_PROXIES,
    timeout: float = 60.0,
    matrix_bytes: int = 0,
) -> Iterator[InstantStack]:
    """The instant upstream and ``hidden-state-proxy proxy`` processes in front of it (each: a
    label and more options); with ``matrix_bytes``, the upstream publishes ``"all_prompt"``
    matrices of that size."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    ring_dir = tempfile.mkdtemp(prefix="hsp-bench-instant-", dir=base)
    app_port = free_port()
    app_url = f"http://127.0.0.1:{app_port}"
    uds = os.path.join(ring_dir, UDS_NAME)
    app_command = [sys.executable, UPSTREAM, "--port", str(app_port), "--ring-dir", ring_dir]
    app_command += ["--uds", uds]
    if matrix_bytes:
        app_command += ["--matrix-bytes", str(matrix_bytes)]
    env = proxy_environment(None)
    try:
        with contextlib.ExitStack() as running:
            app = running.enter_context(
                started(
                    app_command,
                    env,
                    log_dir / "instant-upstream.log",
                    app_url + "/health",
                    timeout,
                    "the instant upstream",
                    progress,
                )
            )
            started_proxies = []
            for number, (label, args) in enumerate(proxies):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                command = [*CLI, "proxy", "--upstream", app_url, "--ring-dir", ring_dir]
                command += ["--port", str(port), "--log-level", "warning"]
                command += [arg.replace("{uds}", uds) for arg in args]
                process = running.enter_context(
                    started(
                        command,
                        env,
                        log_dir / f"instant-proxy-{number}.log",
                        url + "/health",
                        timeout,
                        f"a proxy ({label}) in front of it",
                        progress,
                    )
                )
                started_proxies.append(Server(label, url, process.pid))
            yield InstantStack(Server("app", app_url, app.pid), tuple(started_proxies))
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)
