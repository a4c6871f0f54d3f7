"""The matrix arm (issue #36): what one proxy process does with the largest matrices.

One proxy (``hidden-state-proxy proxy``, default options but ``--send-timeout``) in front of
the instant upstream, whose fake hook publishes an ``"all_prompt"`` matrix of ``matrix_mib``
MiB (base64 float32 in the answer: 4/3 of that on the wire) for every flagged completion:

- ``pull``: one client pulls matrices back to back; MB/s of matrix rows (float32) served,
  then four clients at once.
- ``ordinary``: four clients send unflagged one-token chats through the same proxy while one
  client pulls matrices back to back, then alone for as long (turns interleaved); p50 and p99
  of each and the rise of p99.
- ``memory``: the proxy's memory (sampled every 0.05 s: private, ``RssAnon``, which the
  budget bounds, and shared, the ring's pages it read, which count in RSS) while one client
  sends prompt lists of
  matrices (8 prompts a request: past ``--max-vectors-size`` at 64 MiB, so 413s) and
  :data:`SILENT_CLIENTS` clients ask for a matrix each and never read, until the proxy cuts
  them (``--send-timeout``); against the idle RSS plus ``--vectors-budget``.

The size sweep (table ``matrix_sizes``, the figure of matrix size against cost): for each
size, a fresh instant upstream and proxy, one client pulling matrices of that size back to
back; time per pull, and the proxy's and the upstream's CPU per matrix.

Vectors here are not vLLM's: the arm measures the proxy's side (the ring copy, CRC, encoding,
sending); the hook's side is the worker's (the ring microbenchmark and the e2e tests).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.servers import Server, instant_stack
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.stats import summarize
from vllm_hidden_state_proxy.bench.usage import PeakRss, rss_mib
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

MIB = 1 << 20
ORDINARY_CONCURRENCY = 4
SILENT_CLIENTS = 20
PROMPTS_PER_LIST = 8
SEND_TIMEOUT = 5.0
TITLE = "Matrices: one proxy process serving the largest matrices"
SIZES_TITLE = "Matrix size against cost: one client pulling matrices back to back"
#: The size sweep pulls about this many MiB per size, in at least MIN_PULLS pulls (CPU time
#: comes in 10 ms ticks: a few hundred ms per size keep a tick noise) and at most MAX_PULLS.
SWEEP_MIB, MIN_PULLS, MAX_PULLS = 512, 4, 64


def matrix_body(prompt: Any = "a b c") -> bytes:
    return orjson.dumps(
        {
            "model": "instant",
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {
                "return_last_hidden_state": True,
                "last_hidden_state_pooling": "all_prompt",
            },
        }
    )


ORDINARY = orjson.dumps(
    {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
)


async def _pull(client: httpx.AsyncClient, expected: int) -> float:
    start = time.perf_counter()
    response = await client.post("/v1/completions", content=matrix_body())
    took = time.perf_counter() - start
    if response.status_code != 200:
        raise BenchError(f"a matrix pull got {response.status_code}: {response.text[:200]}")
    if len(response.content) < expected:
        raise BenchError(f"a matrix pull got {len(response.content)} bytes, not {expected}+")
    return took


async def _pull_rate(url: str, matrix: int, pulls: int, clients: int) -> float:
    """MB/s (10^6) of matrix rows served to ``clients`` clients pulling ``pulls`` each."""
    expected = matrix * 4 // 3
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await _pull(client, expected)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(
            *(_pull_n(client, expected, pulls) for _ in range(clients)),
        )
        seconds = time.perf_counter() - start
    return clients * pulls * matrix / seconds / 1e6


async def _pull_n(client: httpx.AsyncClient, expected: int, pulls: int) -> None:
    for _ in range(pulls):
        await _pull(client, expected)


async def _ordinary(url: str, until: asyncio.Event) -> list[float]:
    """Unflagged one-token chats, :data:`ORDINARY_CONCURRENCY` in flight, until ``until``."""
    latencies: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not until.is_set():
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", content=ORDINARY)
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise BenchError(f"an ordinary chat got {response.status_code}")

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(ORDINARY_CONCURRENCY)))
    return latencies


async def _ordinary_alone(url: str, seconds: float) -> list[float]:
    until = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, until.set)
    return await _ordinary(url, until)


#: The puller beside the ordinary clients: its own process, so that reading and joining
#: 85 MB answers does not stall the event loop that times the ordinary chats.
_PULLER = """
import sys, httpx
url, body, pulls, expected = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
with httpx.Client(base_url=url, timeout=300) as client:
    for _ in range(pulls):
        response = client.post("/v1/completions", content=body)
        if response.status_code != 200 or len(response.content) < expected:
            sys.exit(f"a matrix pull got {response.status_code}, {len(response.content)} bytes")
"""


async def _ordinary_beside_pulls(url: str, matrix: int, pulls: int) -> tuple[list[float], float]:
    """Ordinary chats while another process pulls ``pulls`` matrices back to back: their
    latencies and the seconds the pulls took."""
    until = asyncio.Event()

    async def pull_then_stop() -> float:
        start = time.perf_counter()
        try:
            args = (url, matrix_body().decode(), str(pulls), str(matrix * 4 // 3))
            puller = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _PULLER, *args, stderr=asyncio.subprocess.PIPE
            )
            _, errors = await puller.communicate()
            if puller.returncode != 0:
                raise BenchError(f"the matrix puller failed: {errors.decode()[-300:]}")
        finally:
            until.set()
        return time.perf_counter() - start

    seconds, latencies = await asyncio.gather(pull_then_stop(), _ordinary(url, until))
    return latencies, seconds


def _silent_clients(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each ask for a matrix and never read."""
    body = matrix_body()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(head + body)
        sockets.append(sock)
    return sockets


async def _lists(url: str, seconds: float) -> dict[int, int]:
    """Prompt lists of matrices for ``seconds``: their statuses, counted."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < deadline:
            body = matrix_body(["a b c"] * PROMPTS_PER_LIST)
            response = await client.post("/v1/completions", content=body)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    return statuses


def private_mib(pid: int) -> tuple[float, float] | None:
    """(private anonymous memory, mapped shared memory) in MiB: RSS split as Linux counts it
    (``RssAnon``, ``RssShmem``); None where it cannot be read. The rings' pages the proxy has
    read count in RSS as shared memory: vLLM's files, not the proxy's allocations."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssShmem"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None


class PeakPrivate(PeakRss):
    """:class:`PeakRss` of the private anonymous memory (``RssAnon``), and the most shared."""

    shared_mib: float | None = None

    def _run(self) -> None:
        while self.pid is not None and not self._stop.is_set():
            found = private_mib(self.pid)
            if found is not None:
                self.peak_mib = max(found[0], self.peak_mib or 0.0)
                self.shared_mib = max(found[1], self.shared_mib or 0.0)
            self._stop.wait(self.interval)


async def _memory(proxy: Server, port: int) -> tuple[PeakPrivate, PeakRss, dict[int, int]]:
    private, rss = PeakPrivate(proxy.pid, 0.05), PeakRss(proxy.pid, 0.05)
    with private, rss:
        silent = await asyncio.to_thread(_silent_clients, port, SILENT_CLIENTS)
        try:
            statuses = await _lists(proxy.url, SEND_TIMEOUT + 3)
        finally:
            for sock in silent:
                sock.close()
    return private, rss, statuses


async def measure_matrix_arm(
    proxy: Server, matrix_mib: int, pulls: int, pulls_beside: int, rounds: int, progress: Progress
) -> Table:
    matrix = matrix_mib * MIB
    idle = private_mib(proxy.pid)
    idle_rss = rss_mib(proxy.pid)
    task = progress.task("matrices: pulls, ordinary chats beside them, memory", 3 * rounds + 1)
    one = await _pull_rate(proxy.url, matrix, pulls, 1)
    four = await _pull_rate(proxy.url, matrix, max(1, pulls // 4), 4)
    task.advance(1)
    alone: list[float] = []
    beside: list[float] = []
    pulled = 0
    for _ in range(rounds):  # interleaved: the machine's other load falls on both
        latencies, seconds = await _ordinary_beside_pulls(proxy.url, matrix, pulls_beside)
        beside += latencies
        pulled += pulls_beside
        task.advance(1)
        alone += await _ordinary_alone(proxy.url, seconds)
        task.advance(1)
    port = int(proxy.url.rsplit(":", 1)[1])
    private, rss, statuses = await _memory(proxy, port)
    after = private_mib(proxy.pid)
    task.advance(rounds)
    task.done()
    base, side = summarize(alone, 1e3), summarize(beside, 1e3)
    budget = ProxySettings(upstream_url=proxy.url).vectors_budget_bytes / MIB
    rows: list[Row] = [
        {"measure": f"MB/s of {matrix_mib} MiB matrices, 1 client", "value": one},
        {"measure": f"MB/s of {matrix_mib} MiB matrices, 4 clients", "value": four},
        {"measure": "ordinary p50 ms, alone", "value": base.p50},
        {"measure": "ordinary p99 ms, alone", "value": base.p99},
        {"measure": "ordinary p50 ms, beside pulls", "value": side.p50},
        {"measure": "ordinary p99 ms, beside pulls", "value": side.p99},
        {"measure": "ordinary p99 rise ms", "value": side.p99 - base.p99},
        {"measure": "matrices pulled beside", "value": pulled},
        {"measure": "proxy RSS MiB, idle (before the arm)", "value": idle_rss},
        {"measure": "proxy private MiB (RssAnon), idle", "value": idle and idle[0]},
        {"measure": "proxy RSS MiB, peak under lists and silent clients", "value": rss.peak_mib},
        {
            "measure": "proxy private MiB, peak under lists and silent clients",
            "value": private.peak_mib,
        },
        {"measure": "proxy shared MiB (the rings' pages read), peak", "value": private.shared_mib},
        {"measure": "proxy private MiB, after (clients gone)", "value": after and after[0]},
        {"measure": "--vectors-budget MiB", "value": budget},
        {
            "measure": "peak - idle - budget MiB (<= 0: within the bound)",
            "value": (
                None
                if private.peak_mib is None or idle is None
                else private.peak_mib - idle[0] - budget
            ),
        },
        {
            "measure": "prompt-list statuses",
            "value": ", ".join(f"{n}x {s}" for s, n in sorted(statuses.items())),
        },
    ]
    return Table(
        TITLE,
        rows,
        f"Base64 float32 all_prompt matrices from the instant upstream's fake hook; "
        f"{ORDINARY_CONCURRENCY} ordinary clients, {rounds} interleaved turns each way: beside "
        f"{pulls_beside} matrix pulls, then alone for as long; memory: {SILENT_CLIENTS} "
        "clients that never read plus one sending "
        f"lists of {PROMPTS_PER_LIST} prompts, for {SEND_TIMEOUT + 3:.0f} s, "
        f"--send-timeout {SEND_TIMEOUT:.0f}.",
    )


def run_matrix_arm(
    log_dir: Path, matrix_mib: int, pulls: int, pulls_beside: int, rounds: int, progress: Progress
) -> Table:
    proxies = [("matrices", ("--send-timeout", str(SEND_TIMEOUT)))]
    with instant_stack(log_dir, progress, proxies, matrix_bytes=matrix_mib * MIB) as stack:
        return asyncio.run(
            measure_matrix_arm(stack.proxies[0], matrix_mib, pulls, pulls_beside, rounds, progress)
        )


def sweep_pulls(matrix_mib: int, most: int = MAX_PULLS) -> int:
    """Pulls of the size sweep for matrices of ``matrix_mib`` MiB, at most ``most``."""
    return max(MIN_PULLS, min(most, SWEEP_MIB // matrix_mib))


async def measure_size(proxy: Server, upstream: Server, matrix_mib: int, pulls: int) -> Row:
    """One client, ``pulls`` matrices of ``matrix_mib`` MiB back to back after one warm-up
    pull: the time per pull and both servers' CPU per matrix (read around all the pulls)."""
    matrix = matrix_mib * MIB
    expected = matrix * 4 // 3
    async with httpx.AsyncClient(base_url=proxy.url, timeout=300) as client:
        await _pull(client, expected)
        proxy_before, upstream_before = proxy.cpu(), upstream.cpu()
        times = [await _pull(client, expected) for _ in range(pulls)]
        proxy_cpu, upstream_cpu = proxy.cpu() - proxy_before, upstream.cpu() - upstream_before
    took = summarize(times, 1e3)
    return {
        "matrix MiB": matrix_mib,
        "pulls": pulls,
        "pull p50 ms": took.p50,
        "pull p90 ms": took.p90,
        "MB/s of rows": pulls * matrix / sum(times) / 1e6,
        "proxy CPU ms/matrix": 1e3 * proxy_cpu / pulls,
        "upstream CPU ms/matrix": 1e3 * upstream_cpu / pulls,
        "proxy CPU ms/MiB": 1e3 * proxy_cpu / pulls / matrix_mib,
    }


def run_size_sweep(
    log_dir: Path, sizes: Sequence[int], progress: Progress, most_pulls: int = MAX_PULLS
) -> Table:
    """A fresh instant upstream and proxy for each size (the upstream publishes one size)."""
    rows: list[Row] = []
    task = progress.task(f"matrix sizes ({', '.join(map(str, sizes))} MiB)", len(sizes))
    for matrix_mib in sizes:
        proxies = [(f"matrices {matrix_mib} MiB", ())]
        with instant_stack(log_dir, progress, proxies, matrix_bytes=matrix_mib * MIB) as stack:
            pulls = sweep_pulls(matrix_mib, most_pulls)
            rows.append(asyncio.run(measure_size(stack.proxies[0], stack.app, matrix_mib, pulls)))
        task.advance(1)
    task.done()
    return Table(
        SIZES_TITLE,
        rows,
        "Base64 float32 all_prompt matrices from the instant upstream's fake hook (4/3 of the "
        "size on the wire), one client, one proxy process with default options; CPU: user + "
        "system time of each server's process tree around all pulls of a size (10 ms ticks). "
        "The upstream's CPU is the fake hook's publication and its answer, not the proxy's.",
    )
