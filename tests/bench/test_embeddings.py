"""The embeddings phase (bench/embeddings.py), against fake servers."""

from __future__ import annotations

import dataclasses
import io
import itertools
from typing import Any

import anyio
import orjson
import pytest

from tests.bench.fakes import HIDDEN, FakeServers
from vllm_hidden_state_proxy.bench import embeddings
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.embeddings import (
    FAN_OUT_LIMIT,
    check_embeddings,
    embedding_chat_body,
    embedding_inputs_body,
    embedding_text,
)
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Table
from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    EmbeddingsDefaults,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.settings import ProxySettings


def run(fake: FakeServers, batches: tuple[int, ...], limit: int = 64) -> Table:
    """6 rounds of one request per arm at each batch size (``--requests 1``)."""
    clock = itertools.count(0.0, 1.0)  # the proxy's CPU clock: a second a reading
    stack = dataclasses.replace(fake.stack("key"), proxy_cpu=lambda: next(clock))
    options = BenchOptions(requests=1, embedding_batches=batches)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(embeddings, "FAN_OUT_LIMIT", limit)
        return anyio.run(embeddings.run, stack, options, Progress(io.StringIO()))


def test_both_arms_take_turns_at_every_batch_size() -> None:
    fake = FakeServers()
    table = run(fake, (1, 16, 40), limit=8)
    assert [row["inputs per request"] for row in table.rows] == [1, 16, 40]
    for row in table.rows:
        assert row["requests"] == 6 and row["hidden size"] == HIDDEN
        for column in ("inputs/s", "vLLM alone inputs/s", "proxy / vLLM alone, inputs/s"):
            value = row[column]
            assert isinstance(value, float) and value > 0
    # A clock reading before and after each of the proxy's 6 turns: 1 s each.
    assert [row["proxy CPU ms per input"] for row in table.rows] == pytest.approx(
        [1e3 * 6 / 6, 1e3 * 6 / 96, 1e3 * 6 / 240]
    )
    sizes = [
        len(document["input"]) for host, path, document in fake.seen if path == "/v1/embeddings"
    ]
    assert sizes == [1] * 7 + [16] * 7 + [40] * 7  # a warm-up, then 6 rounds of 1
    assert fake.count("vllm") == (1 + 6) * (1 + 16 + 40)
    assert fake.peak <= 8  # the direct arm keeps at most `limit` chats in flight
    texts = [str(d.get("input") or d["messages"]) for _, _, d in fake.seen]
    assert len(texts) == len(set(texts))  # every input a text of its own
    assert fake.authorization == {("proxy", "Bearer key"), ("vllm", None)}


def test_a_wrong_count_of_vectors_stops_the_run() -> None:
    with pytest.raises(BenchError, match="embeddings: 15 vectors for 16 inputs"):
        run(FakeServers(short_after=1), (16,))  # the warm-up is whole, then one short


def test_a_whole_answer_is_checked_item_by_item() -> None:
    def answer(*sizes: int) -> dict[str, Any]:
        return {"data": [{"index": i, "embedding": [0.5] * n} for i, n in enumerate(sizes)]}

    assert check_embeddings(answer(4, 4), 2) == 4
    for bad, batch in (
        (answer(4), 2),
        (answer(4, 3), 2),
        ({"data": [{"index": 1, "embedding": [1]}]}, 1),
        ({}, 1),
    ):
        with pytest.raises(BenchError):
            check_embeddings(bad, batch)


def test_the_direct_arm_keeps_as_many_chats_in_flight_as_the_proxy_by_default() -> None:
    assert ProxySettings.fan_out_limit == FAN_OUT_LIMIT


def test_embedding_inputs_are_distinct_texts_and_the_direct_chat_is_the_proxys() -> None:
    body = orjson.loads(embedding_inputs_body("m", [10, 11]))
    assert body == {
        "model": "m",
        "input": [embedding_text(10), embedding_text(11)],
        "encoding_format": "float",
    }
    plan = plan_embeddings(
        {"model": "m", "input": [embedding_text(5), embedding_text(6)]},
        EmbeddingsDefaults(template=DEFAULT_TEMPLATE, max_inputs=16),
    )
    assert [path for path, _ in plan.calls] == ["/v1/chat/completions"] * 2
    assert [orjson.loads(embedding_chat_body("m", i)) for i in (5, 6)] == [
        document for _, document in plan.calls
    ]  # the proxy adds only the flag on its way to vLLM
