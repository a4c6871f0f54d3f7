"""Looking at the running test stack from outside: the proxy process, vLLM's /metrics.

Used by the load and connection-fault tests (issue #7): the proxy's resident memory, its open
connections to vLLM, and vLLM's running, waiting and completed requests and generated tokens.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from tests.e2e.server import RunningStack

MIB = 1024 * 1024


def proxy_process(stack: RunningStack) -> psutil.Process:
    """The proxy: the child of ``serve`` that runs ``vllm_hidden_state_proxy.cli proxy``."""
    found = [
        child
        for child in psutil.Process(stack.process.pid).children(recursive=True)
        if _is_proxy_command(child.cmdline())
    ]
    assert len(found) == 1, f"expected one proxy process below serve, found {found}"
    return found[0]


def _is_proxy_command(command: list[str]) -> bool:
    for index, word in enumerate(command[:-1]):
        if word == "vllm_hidden_state_proxy.cli":
            return command[index + 1] == "proxy"
    return False


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid``'s process and every process below it."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def vllm_processes(stack: RunningStack) -> list[psutil.Process]:
    """vLLM's API server (the child of ``serve`` running vLLM's OpenAI server) and everything
    below it (engine core, workers)."""
    servers = [
        child
        for child in psutil.Process(stack.process.pid).children()
        if "vllm.entrypoints.openai.api_server" in child.cmdline()
    ]
    assert len(servers) == 1, f"expected one vLLM API server below serve, found {servers}"
    return process_tree(servers[0].pid)


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """The processes stand still (SIGSTOP) until the block ends (SIGCONT)."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def vllm_engine_yielding(stack: RunningStack) -> Iterator[None]:
    """vLLM's engine (every thread of every process below its API server) runs at the lowest
    priority until the block ends: on a loaded machine its API server then keeps up with the
    outputs and answers /metrics while the engine generates, instead of falling seconds behind.
    Only the odds of a look at the counters arriving early change, never what a test checks."""
    _, *engine = vllm_processes(stack)
    threads = [thread.id for process in engine for thread in process.threads()]
    before: dict[int, int] = {}
    try:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        yield
    finally:
        for tid, priority in before.items():
            # Raising a priority again needs CAP_SYS_NICE; without it the engine stays niced.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, tid, priority)


def vllm_engine_frozen(stack: RunningStack) -> contextlib.AbstractContextManager[None]:
    """vLLM's engine (every process below its API server) stops until the block ends, while
    the API server keeps answering: it sees a client hang up and sends the engine its abort,
    which the engine reads before its next steps when it goes on."""
    server, *engine = vllm_processes(stack)
    assert engine, f"vLLM's API server {server.pid} has no engine process below it"
    return stopped([process.pid for process in engine])


def hang_ups_pending(process: psutil.Process, port: int) -> int:
    """Connections to ``process``'s local ``port`` that the client has closed and the process
    has not (CLOSE_WAIT): hang-ups the server has yet to notice."""
    return sum(
        1
        for connection in process.net_connections(kind="tcp")
        if connection.status == psutil.CONN_CLOSE_WAIT and connection.laddr.port == port
    )


def rss(process: psutil.Process) -> int:
    return int(process.memory_info().rss)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def connections_to(process: psutil.Process, port: int) -> int:
    """The process's established TCP connections to 127.0.0.1:``port``."""
    return sum(
        1
        for connection in process.net_connections(kind="tcp")
        if connection.status == psutil.CONN_ESTABLISHED
        and connection.raddr
        and connection.raddr.port == port
    )


def queue_bytes(port: int, *, received: bool = False) -> int:
    """Bytes in the kernel queues of the TCP sockets bound to local ``port``
    (``/proc/net/tcp``): by default the send queues (what a server has written that its clients
    have not read yet); with ``received``, the receive queues (what clients sent that the
    server has not read)."""
    total = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                total += int(fields[4].split(":")[1 if received else 0], 16)
    return total


def metric(text: str, name: str, label: str = "") -> float:
    """Sum of the samples called ``name`` (whose labels contain ``label``) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        sample = head.split("{", 1)[0]
        if sample == name and label in head:
            total += float(value)
    return total


def served_per_engine(text: str) -> dict[str, float]:
    """vLLM's completed requests per engine label (``vllm:request_success_total{engine=...}``)
    in Prometheus text (vLLM's own /metrics, or a proxy's, which carries vLLM's)."""
    served: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                served[engine[1]] = served.get(engine[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return served


def proxy_gauge_in(text: str, name: str) -> float:
    """The proxy's own gauge ``hidden_state_proxy_<name>`` in its /metrics text."""
    match = re.search(rf"^hidden_state_proxy_{name} (\S+)$", text, re.MULTILINE)
    assert match, f"no {name} in the proxy's metrics"
    return float(match[1])


#: vLLM's HTTP request counter's label for its completions route.
COMPLETIONS_HANDLER = 'handler="/v1/completions"'


def vllm_metrics(stack: RunningStack) -> str:
    """vLLM's own /metrics (asked directly, not through the proxy). Its API server answers
    late while it pushes megabytes of streams on a loaded machine: a generous timeout."""
    response = httpx.get(stack.vllm_url + "/metrics", timeout=60)
    response.raise_for_status()
    return response.text


@dataclass(frozen=True)
class Progress:
    """One look at vLLM's counters."""

    #: Requests running or waiting.
    in_flight: float
    #: Requests completed (stop or length; aborted requests are not counted).
    finished: float
    #: Tokens generated so far (an aborted request stops adding to it).
    generated: float


def progress(stack: RunningStack) -> Progress:
    text = vllm_metrics(stack)
    return Progress(
        in_flight=metric(text, "vllm:num_requests_running")
        + metric(text, "vllm:num_requests_waiting"),
        finished=metric(text, "vllm:request_success_total"),
        generated=metric(text, "vllm:generation_tokens_total"),
    )


def in_flight(stack: RunningStack) -> float:
    """vLLM's running + waiting requests."""
    return progress(stack).in_flight


def ring_publishes(ring_dir: Path) -> int:
    """Records the rings in ``ring_dir`` have published so far (a flagged prefill adds one)."""
    from vllm_hidden_state_proxy.ring import RingDirectory

    with RingDirectory(ring_dir) as rings:
        return sum(rings.publish_marks().values())


def wait_until(
    condition: Callable[[], bool], timeout: float, interval: float = 0.05
) -> float | None:
    """Seconds until ``condition()`` held, or ``None`` if it did not within ``timeout``."""
    start = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            return None
        time.sleep(interval)


def wait_idle(stack: RunningStack, timeout: float = 5.0) -> float:
    """Seconds until vLLM has nothing running or waiting; fails after ``timeout``."""
    waited = wait_until(lambda: in_flight(stack) == 0, timeout)
    assert waited is not None, (
        f"vLLM still has {in_flight(stack):g} running/waiting request(s) after {timeout} s"
    )
    return waited


def raw_post(
    url: str, path: str, body: bytes, *, receive_buffer: int | None = None
) -> socket.socket:
    """Send one HTTP/1.1 POST on a fresh socket and return the socket, response unread.

    ``receive_buffer`` shrinks the socket's receive buffer (set before connecting, so that the
    kernel advertises a small window): a client that does not read then pushes back quickly.
    """
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(60)
    sock.connect((parts.hostname, parts.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode("ascii")
    sock.sendall(head + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, count: int = 1, limit: int = 1 << 24) -> bytes:
    """Read from ``sock`` until ``marker`` has been seen ``count`` times (or the peer closed)."""
    data = bytearray()
    while data.count(marker) < count and len(data) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def read_http_response(sock: socket.socket, timeout: float) -> tuple[int, bytes] | None:
    """Status and body of the (Content-Length) response on ``sock``, or ``None`` if it does
    not arrive within ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        assert length is not None, head
        while len(body) < int(length.group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except TimeoutError:
        return None
    return int(head.split(b" ", 2)[1]), body


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def prefix_cache_hits(stack: RunningStack) -> float:
    """vLLM's prefix cache hits so far (tokens), summed over its engines."""
    text = httpx.get(stack.vllm_url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )
