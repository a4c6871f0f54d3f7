"""CPU time and memory (bench/usage.py), of this very process."""

from __future__ import annotations

import os
import socket
import time

from vllm_hidden_state_proxy.bench.usage import (
    PeakRss,
    listening_pid,
    rss_mib,
    tree_cpu_seconds,
    tree_memory_mib,
)

GONE = 2**22 + 12345  # above Linux's largest pid


def test_cpu_time_grows_as_this_process_works() -> None:
    before = tree_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn a few of the kernel's 10 ms ticks
        pass
    assert tree_cpu_seconds(os.getpid()) > before > 0


def test_memory_of_a_process_and_of_a_tree() -> None:
    rss = rss_mib(os.getpid())
    assert rss is not None and rss > 1
    tree = tree_memory_mib(os.getpid())
    assert tree is not None and tree[0] >= rss * 0.5 and tree[1] > 0
    assert rss_mib(GONE) is None and tree_memory_mib(GONE) is None


def test_the_listener_of_a_port_is_found() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert listening_pid(server.getsockname()[1]) == os.getpid()


def test_the_peak_sampler_reads_at_least_once() -> None:
    with PeakRss(os.getpid(), interval=0.01) as peak:
        time.sleep(0.05)
    assert peak.peak_mib is not None and peak.peak_mib > 1
    with PeakRss(None) as nothing:
        pass
    assert nothing.peak_mib is None
