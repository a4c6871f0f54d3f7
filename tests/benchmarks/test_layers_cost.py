"""The layers-cost check (benchmarks/layers_cost.py) on faked servers: each visit sends both
kinds of traffic in turns, the tallies add up over visits, and the table compares the two
servers."""

from __future__ import annotations

import io
import itertools

import anyio
from benchmarks.layers_cost import (
    KINDS,
    VISITS,
    WARMUP,
    layers_table,
    measure_visit,
)

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.turns import Tally


def test_each_visit_sends_both_kinds_and_the_table_compares_the_servers() -> None:
    tallies = {(server, kind): Tally() for server in VISITS for kind, _ in KINDS}
    clock = itertools.count(1)  # a CPU clock that moves by 1 s per reading
    servers = {"without": FakeServers(), "with": FakeServers()}
    for server in VISITS:
        anyio.run(
            measure_visit,
            servers[server].stack(),
            {kind: tallies[(server, kind)] for kind, _ in KINDS},
            64,
            2,
            lambda: float(next(clock)),
            Progress(io.StringIO()),
        )
    for fake in servers.values():
        flagged = [d for _, _, d in fake.seen if "kv_transfer_params" in d]
        unflagged = [d for _, _, d in fake.seen if "kv_transfer_params" not in d]
        # per visit: a warm-up burst plus 2 rounds of 32 requests for each kind; two visits
        assert len(flagged) == len(unflagged) == 2 * (WARMUP + 2 * 32)
    for (_, _), tally in tallies.items():
        assert tally.requests == 2 * 2 * 32 and len(tally.rates) == 4
        assert tally.cpu_ms == 1e3 * 4 / tally.requests  # 1 s per burst
    table = layers_table(tallies)
    assert [row["traffic"] for row in table.rows] == ["unflagged", "flagged"]
    for row in table.rows:
        with_over_without = row["with / without"]
        assert isinstance(with_over_without, float) and with_over_without > 0
        assert isinstance(row["req/s with layers"], float)


def test_a_server_on_another_machine_has_no_cpu_column() -> None:
    tally = Tally()
    tally.add(10, 1.0, [], None)
    tally.add(10, 1.0, [], 0.5)
    assert tally.cpu_ms is None and tally.rate == 10.0
