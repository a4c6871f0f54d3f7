"""Resident memory of processes and process trees, read from Linux's ``/proc``.

RSS counts every page a process has mapped in, shared ones included, so the RSS of a process
tree double-counts what its processes share (libraries, torch's shared memory); PSS splits
shared pages between their users and adds up honestly. Both are reported.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
MIB = 1024 * 1024
_TCP_LISTEN = "0A"


def _status_kib(path: Path, field: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident set size of one process (``VmRSS``), or None if it is gone or unreadable."""
    kib = _status_kib(PROC / str(pid) / "status", "VmRSS")
    return None if kib is None else kib * 1024


def pss_bytes(pid: int) -> int | None:
    """Proportional set size of one process (``smaps_rollup``), or None."""
    kib = _status_kib(PROC / str(pid) / "smaps_rollup", "Pss")
    return None if kib is None else kib * 1024


def _parent_of(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren...)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


@dataclass(frozen=True)
class TreeMemory:
    """Memory of a process and everything below it, in MiB."""

    processes: int
    rss_mib: float
    pss_mib: float


def tree_memory(pid: int) -> TreeMemory | None:
    """RSS and PSS summed over ``pid`` and its descendants, or None if ``pid`` is gone."""
    rss_total = 0
    pss_total = 0
    count = 0
    for member in [pid, *descendants(pid)]:
        rss = rss_bytes(member)
        if rss is None:
            continue
        count += 1
        rss_total += rss
        pss_total += pss_bytes(member) or 0
    if count == 0:
        return None
    return TreeMemory(processes=count, rss_mib=rss_total / MIB, pss_mib=pss_total / MIB)


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == _TCP_LISTEN:
                inodes.add(fields[9])
    return inodes


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine (the lowest pid if several share
    the socket), or None if there is none or its descriptors are not readable by us."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        owners.append(int(entry.name))
                        break
    return min(owners) if owners else None


def _task_cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of one process (``schedstat``, exact)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total


def tree_cpu_seconds(pid: int) -> float:
    """On-CPU seconds so far of ``pid``, its descendants and all their threads (threads that
    already exited are not counted: compare two readings across a stretch where none exits)."""
    return sum(_task_cpu_ns(member) for member in [pid, *descendants(pid)]) / 1e9


class PeakRss:
    """Samples one process's RSS from a background thread; ``peak_mib`` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self.samples = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is not None:
                self.samples += 1
                self._peak = max(self._peak, rss)
            self._stop.wait(self.interval)

    @property
    def peak_mib(self) -> float | None:
        return self._peak / MIB if self.samples else None

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
