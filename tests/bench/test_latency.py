"""The latency arms (bench/latency.py), against fake servers."""

from __future__ import annotations

import io
from typing import Any

import anyio
import pytest

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench import latency
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.turns import round_robin
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY

ARMS = ["direct", "direct_hooked", "passthrough", "flagged_float", "flagged_base64"]
#: 5 requests per arm after a warm-up request each (--smoke's).
FIVE = BenchOptions(requests=5, smoke=True)


def arm_of(host: str, document: dict[str, Any]) -> str:
    kv = document.get("kv_transfer_params")
    if kv is None and host == "vllm":
        key = document.get("vllm_xargs", {}).get(REQUEST_KEY_ENTRY)
        return "direct" if key is None else "direct_hooked"
    if kv is None:
        return "passthrough"
    return "flagged_base64" if "last_hidden_state_format" in kv else "flagged_float"


def test_the_arms_take_turns_request_by_request_each_with_a_prompt_of_its_own() -> None:
    fake = FakeServers()
    table = anyio.run(latency.run, fake.stack("key"), FIVE, Progress(io.StringIO()))
    assert [row["arm"] for row in table.rows] == ARMS
    for row in table.rows:
        assert row["n"] == 5 and isinstance(row["p50 ms"], float) and row["p50 ms"] > 0
    assert table.get("direct", "p50 / direct") == 1.0
    assert table.get("flagged_float", "p50 / passthrough") is not None
    assert table.get("passthrough", "p50 / passthrough") is None
    assert [arm_of(host, document) for host, _, document in fake.seen] == [
        arm
        for _, arm in round_robin(ARMS, 1)  # warm-up
    ] + [arm for _, arm in round_robin(ARMS, 5)]
    prompts = [document["messages"][0]["content"] for _, _, document in fake.seen]
    assert len(set(prompts)) == len(prompts) == len(ARMS) * 6
    keys = [d["vllm_xargs"][REQUEST_KEY_ENTRY] for _, _, d in fake.seen if "vllm_xargs" in d]
    assert len(set(keys)) == len(keys) == 6 and all(len(key) == 32 for key in keys)
    assert fake.authorization == {("vllm", None), ("proxy", "Bearer key")}


def test_a_failed_request_stops_the_run() -> None:
    fake = FakeServers(failing=ARMS.index("flagged_float") + 1)
    with pytest.raises(BenchError, match="flagged_float: HTTP 503: busy"):
        anyio.run(latency.run, fake.stack(), FIVE, Progress(io.StringIO()))
