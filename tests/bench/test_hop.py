"""The CPU-time arms (bench/hop.py), against fake servers."""

from __future__ import annotations

import dataclasses
import io
import itertools

import anyio

from tests.bench.fakes import FakeServers
from tests.bench.test_latency import ARMS
from vllm_hidden_state_proxy.bench import hop
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress


def test_cpu_per_request_is_read_around_each_arms_requests() -> None:
    fake = FakeServers()
    proxy_clock, vllm_clock = itertools.count(0.0, 0.5), itertools.count(0.0, 2.0)
    stack = dataclasses.replace(
        fake.stack(), proxy_cpu=lambda: next(proxy_clock), vllm_cpu=lambda: next(vllm_clock)
    )
    options = BenchOptions(smoke=True)
    table = anyio.run(hop.run, stack, options, Progress(io.StringIO()))
    assert [row["arm"] for row in table.rows] == ARMS
    for row in table.rows:  # one tick of each clock per arm, over its 50 requests (the least)
        assert (row["requests"], row["proxy CPU ms"], row["vLLM CPU ms"]) == (50, 10.0, 40.0)
    assert fake.count("vllm") + fake.count("proxy") == len(ARMS) * 51  # and a request to connect
    no_clocks = anyio.run(hop.run, fake.stack(), options, Progress(io.StringIO()))
    assert no_clocks.get("direct", "proxy CPU ms") is None
