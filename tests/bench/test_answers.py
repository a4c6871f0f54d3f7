"""The answers arms (bench/answers.py), against fake servers."""

from __future__ import annotations

import io
from typing import Any

import anyio

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench import answers
from vllm_hidden_state_proxy.bench.answers import ANSWER_TOKENS
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.turns import round_robin

ARMS = [
    "direct",
    "flagged_last",
    "flagged_last_answer",
    "flagged_all_prompt",
    "flagged_all_answer",
    "flagged_spans",
]


def arm_of(document: dict[str, Any]) -> str:
    kv = document.get("kv_transfer_params")
    if kv is None:
        return "direct"
    if "last_hidden_state_spans" in kv:
        return "flagged_spans"
    return f"flagged_{kv.get('last_hidden_state_pooling', 'last')}"


def test_the_arms_take_turns_with_answers_of_the_same_length() -> None:
    fake = FakeServers()
    options = BenchOptions(requests=16, smoke=True)  # 4 requests per arm, one warm-up each
    table = anyio.run(answers.run, fake.stack("key"), options, Progress(io.StringIO()))
    assert [row["arm"] for row in table.rows] == ARMS
    assert table.get("direct", "p50 / direct") == 1.0
    assert table.get("flagged_last_answer", "p50 / flagged_last") is not None
    assert table.get("flagged_last", "p50 / flagged_last") is None
    assert all(int(table.get(arm, "answer bytes") or 0) > 0 for arm in ARMS)
    seen = [document for _, _, document in fake.seen]
    assert [arm_of(document) for document in seen] == [arm for _, arm in round_robin(ARMS, 1)] + [
        arm for _, arm in round_robin(ARMS, 4)
    ]
    assert {document["max_tokens"] for document in seen} == {ANSWER_TOKENS}
    assert all(document["ignore_eos"] for document in seen)
    flagged = [d["kv_transfer_params"] for d in seen if "kv_transfer_params" in d]
    assert all(kv["last_hidden_state_format"] == "base64" for kv in flagged)
