"""CPU time and resident memory of the servers (psutil).

CPU time is the kernel's user + system time of a process and everything below it, which Linux
reports in ticks of 10 ms: the phases that divide it by a request count take enough requests
that a tick is noise. RSS counts every page a process maps, shared ones included, so the RSS
of a process tree double-counts what its processes share; PSS splits shared pages between
their users. Both are reported for vLLM.
"""

from __future__ import annotations

import contextlib
import threading

try:
    import psutil
except ImportError as missing:  # not a dependency of the proxy itself
    raise ImportError(
        "hidden-state-proxy bench needs psutil: pip install 'vllm-hidden-state-proxy[bench]'"
    ) from missing

MIB = 1024 * 1024
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)


def _tree_sum(pid: int, read: str, *fields: str) -> tuple[float, ...] | None:
    """Each of ``fields`` of ``psutil.Process.<read>()`` summed over ``pid`` and its live
    descendants, or None if ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except _GONE:
        return None
    totals = [0.0] * len(fields)
    for process in members:
        with contextlib.suppress(*_GONE):
            found = getattr(process, read)()
            totals = [
                t + float(getattr(found, name)) for t, name in zip(totals, fields, strict=True)
            ]
    return tuple(totals)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    return sum(_tree_sum(pid, "cpu_times", "user", "system") or (0.0,))


def rss_mib(pid: int) -> float | None:
    """Resident set size of one process, or None if it is gone."""
    try:
        return float(psutil.Process(pid).memory_info().rss) / MIB
    except _GONE:
        return None


def tree_memory_mib(pid: int) -> tuple[float, float] | None:
    """(RSS, PSS) summed over ``pid`` and its descendants, or None if ``pid`` is gone."""
    found = _tree_sum(pid, "memory_full_info", "rss", "pss")
    return None if found is None else (found[0] / MIB, found[1] / MIB)


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` here (the lowest pid if several share the
    socket), or None if there is none or it is not ours to see."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    owners = [
        int(c.pid)
        for c in connections
        if c.pid is not None and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    ]
    return min(owners, default=None)


class PeakRss:
    """Samples one process's RSS from a thread while the block runs; ``peak_mib`` is the most
    seen (None if it could not be read)."""

    def __init__(self, pid: int | None, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while self.pid is not None and not self._stop.is_set():
            rss = rss_mib(self.pid)
            if rss is not None:
                self.peak_mib = max(rss, self.peak_mib or 0.0)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
