"""The layers-cost phase (bench/layers_cost.py) on faked stacks: both stacks get their bursts,
unflagged and flagged, and the table compares them."""

from __future__ import annotations

import io

import anyio

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.layers_cost import CONCURRENCY, measure_layers_cost
from vllm_hidden_state_proxy.bench.progress import Progress


def test_both_stacks_take_turns_and_the_table_compares_them() -> None:
    plain, layered = FakeServers(), FakeServers()
    table = anyio.run(
        measure_layers_cost, plain.stack(), layered.stack(), 64, 2, Progress(io.StringIO())
    )
    assert [row["traffic"] for row in table.rows] == ["unflagged", "flagged"]
    for row in table.rows:
        assert isinstance(row["with / without"], float) and row["with / without"] > 0
    for servers in (plain, layered):
        flagged = [d for h, _, d in servers.seen if "kv_transfer_params" in d]
        unflagged = [d for h, _, d in servers.seen if "kv_transfer_params" not in d]
        # warm-up burst plus 2 rounds of 32 requests for each kind
        assert len(flagged) == len(unflagged) == CONCURRENCY + 2 * 32
