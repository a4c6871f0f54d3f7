"""The hop alone (benchmarks/instant.py, benchmarks/servers.py): real proxies in front of the
real instant upstream, with small counts. No timing thresholds: the numbers must only be there."""

from __future__ import annotations

import io
from collections.abc import Iterator

import anyio
import pytest
from benchmarks.instant import (
    cpu_arms,
    measure_instant,
    measure_instant_throughput,
)
from benchmarks.servers import Server, instant_stack

from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Table

#: Per arm: enough that each server's CPU time spans several of Linux's 10 ms ticks.
REQUESTS = 300
#: The default and the default over a Unix socket side by side, and with two workers.
PROXIES = (
    ("http1", ()),
    ("uds", ("--upstream-uds", "{uds}")),
    ("2 workers", ("--workers", "2")),
)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[Server]]]:
    logs = tmp_path_factory.mktemp("instant")
    with instant_stack(logs, Progress(io.StringIO()), PROXIES) as stack:
        yield stack.app, list(stack.proxies)


@pytest.fixture(scope="module")
def table(targets: tuple[Server, list[Server]]) -> Table:
    app, proxies = targets
    return anyio.run(measure_instant, app, proxies[:2], REQUESTS, 2, Progress(io.StringIO()))


def test_every_arm_sends_its_requests(table: Table, targets: tuple[Server, list[Server]]) -> None:
    arms = cpu_arms(targets[0], targets[1][:2])
    assert [row["arm"] for row in table.rows] == [arm.name for arm in arms]
    assert "passthrough (uds)" in [arm.name for arm in arms]
    assert [row["requests"] for row in table.rows] == [REQUESTS] * len(arms)
    for row in table.rows:
        latency = row["p50 ms"]
        assert isinstance(latency, float) and latency > 0


def test_a_proxy_costs_cpu_only_where_it_is_in_the_path(
    table: Table, targets: tuple[Server, list[Server]]
) -> None:
    for arm in cpu_arms(targets[0], targets[1][:2]):
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


def test_throughput_through_one_and_two_workers(targets: tuple[Server, list[Server]]) -> None:
    app, proxies = targets
    table = anyio.run(
        measure_instant_throughput,
        app,
        [proxies[0], proxies[2]],
        64,
        2,
        Progress(io.StringIO()),
        8,
    )
    rates = {row["target"]: row["req/s (median of rounds)"] for row in table.rows}
    assert set(rates) == {"bare app", "proxy (http1)", "proxy (2 workers)"}
    assert all(isinstance(rate, float) and rate > 0 for rate in rates.values())


def test_two_workers_give_every_flagged_request_its_vector_and_count_it_once(
    targets: tuple[Server, list[Server]],
) -> None:
    """``--workers 2``: both processes read the ring, and ``/metrics`` (answered by whichever
    worker) sums the rows of the table the workers share."""
    import concurrent.futures

    import httpx
    import psutil
    from benchmarks.instant_upstream import HIDDEN_SIZE

    from vllm_hidden_state_proxy.protocol import WORKER_METRICS_ENV
    from vllm_hidden_state_proxy.proxy import metrics

    proxy = targets[1][2]
    flagged = metrics.PREFIX + "flagged_requests_total"

    def total() -> float:
        text = httpx.get(proxy.url + "/metrics", timeout=30).text
        return float(
            next(line for line in text.splitlines() if line.startswith(flagged + " "))[
                len(flagged) :
            ]
        )

    def ask(index: int) -> list[float]:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"worker {index}"}],
            "kv_transfer_params": {"return_last_hidden_state": True},
        }
        with httpx.Client() as client:  # a connection of its own: either worker may take it
            response = client.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        vector: list[float] = response.json()["kv_transfer_params"]["last_hidden_state"]
        return vector

    before = total()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        vectors = list(pool.map(ask, range(64)))
    expected = [i / HIDDEN_SIZE for i in range(HIDDEN_SIZE)]  # what the instant upstream sends
    assert all(vector == pytest.approx(expected, abs=1e-7) for vector in vectors)
    assert total() - before == 64

    workers = psutil.Process(proxy.pid).children(recursive=True)
    paths = {worker.environ().get(WORKER_METRICS_ENV) for worker in workers} - {None}
    assert len(paths) == 1, "the workers share one metrics table"
    table = metrics.MetricsTable(paths.pop())
    try:
        owned = {pid: row[metrics._FLAGGED] for pid, row in table.rows().items()}
    finally:
        table.close()
    assert set(owned) <= {worker.pid for worker in workers}  # each worker's own row
    assert len(owned) == 2
    assert sum(owned.values()) == total()
