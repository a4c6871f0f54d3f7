"""The CPU-time arms (bench/hop.py), against fake servers."""

from __future__ import annotations

import io
import itertools

import anyio

from tests.bench.fakes import FakeServers
from tests.bench.test_latency import ARMS
from vllm_hidden_state_proxy.bench.hop import measure_cpu
from vllm_hidden_state_proxy.bench.progress import Progress


def test_cpu_per_request_is_read_around_each_arms_requests() -> None:
    fake = FakeServers()
    proxy_clock, vllm_clock = itertools.count(0.0, 0.5), itertools.count(0.0, 2.0)
    table = anyio.run(
        measure_cpu,
        fake.stack(),
        10,
        lambda: next(proxy_clock),
        lambda: next(vllm_clock),
        Progress(io.StringIO()),
    )
    assert [row["arm"] for row in table.rows] == ARMS
    for row in table.rows:  # one tick of each clock per arm, over its 10 requests
        assert (row["requests"], row["proxy CPU ms"], row["vLLM CPU ms"]) == (10, 50.0, 200.0)
    assert fake.count("vllm") + fake.count("proxy") == 4 * 11  # and a request to connect
    no_clocks = anyio.run(measure_cpu, fake.stack(), 2, None, None, Progress(io.StringIO()))
    assert no_clocks.get("direct", "proxy CPU ms") is None
