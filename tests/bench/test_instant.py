"""The hop alone (bench/instant.py, servers.instant_stack): a real proxy in front of the real
instant upstream, with small counts. No timing thresholds: the numbers must only be there."""

from __future__ import annotations

import io

import anyio
import pytest

from vllm_hidden_state_proxy.bench.instant import ARMS, measure_instant
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Table
from vllm_hidden_state_proxy.bench.servers import instant_stack
from vllm_hidden_state_proxy.bench.usage import tree_cpu_seconds

#: Per arm: enough that each server's CPU time spans several of Linux's 10 ms ticks.
REQUESTS = 300


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Table:
    logs = tmp_path_factory.mktemp("instant")
    progress = Progress(io.StringIO())
    with instant_stack(logs, progress) as stack:
        return anyio.run(
            measure_instant,
            stack.app_url,
            stack.proxy_url,
            lambda: tree_cpu_seconds(stack.app_pid),
            lambda: tree_cpu_seconds(stack.proxy_pid),
            REQUESTS,
            2,
            progress,
        )


def test_every_arm_sends_its_requests(table: Table) -> None:
    assert [row["arm"] for row in table.rows] == [arm.name for arm in ARMS]
    assert [row["requests"] for row in table.rows] == [REQUESTS] * len(ARMS)
    for row in table.rows:
        latency = row["p50 ms"]
        assert isinstance(latency, float) and latency > 0


def test_the_proxy_costs_cpu_only_where_it_is_in_the_path(table: Table) -> None:
    for arm in ARMS:
        proxy, app = (
            table.get(arm.name, "proxy CPU ms/request"),
            table.get(arm.name, "app CPU ms/request"),
        )
        assert app is not None and app >= 0
        if arm.via_proxy:
            assert proxy is not None and proxy > 0
            assert (table.get(arm.name, "proxy / app CPU") or 0) > 0
        else:
            assert proxy is None and table.get(arm.name, "proxy / app CPU") is None
