"""The embeddings phase (bench/embeddings.py) and the API key, against fake servers."""

from __future__ import annotations

import functools
import io
import json
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.bench import client as bench_client
from vllm_hidden_state_proxy.bench import embeddings as bench_embeddings
from vllm_hidden_state_proxy.bench.client import (
    BenchError,
    embedding_chat_body,
    embedding_inputs_body,
    embedding_text,
    new_client,
)
from vllm_hidden_state_proxy.bench.embeddings import (
    EMBEDDINGS_DIRECT,
    EMBEDDINGS_PROXY,
    check_embeddings,
    embeddings_in,
    embeddings_routes,
    fan_out,
    measure_embeddings,
    probe_problem,
    skipped_arms,
)
from vllm_hidden_state_proxy.bench.latency import routes
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import EmbeddingsArm
from vllm_hidden_state_proxy.bench.streaming import stream_routes
from vllm_hidden_state_proxy.bench.throughput import load_routes
from vllm_hidden_state_proxy.proxy.embeddings_request import DEFAULT_TEMPLATE, plan_embeddings

PROXY = "http://proxy"
VLLM = "http://vllm"
HIDDEN = 4


def answer(count: int, size: int = HIDDEN) -> dict[str, Any]:
    """An embeddings answer as the proxy writes it (orjson, compact)."""
    data = [{"object": "embedding", "index": i, "embedding": [0.5] * size} for i in range(count)]
    return {"object": "list", "data": data, "model": "m", "usage": {"prompt_tokens": count}}


def test_inputs_are_distinct_short_texts_sent_as_one_request() -> None:
    body = orjson.loads(embedding_inputs_body("m", 10, 3))
    assert body == {
        "model": "m",
        "input": [embedding_text(10), embedding_text(11), embedding_text(12)],
        "encoding_format": "float",
    }
    assert len({embedding_text(i) for i in range(500)}) == 500
    assert all(len(embedding_text(i)) < 100 for i in (0, 10**7))


def test_the_direct_chat_is_the_one_the_proxy_plans_for_that_input() -> None:
    plan = plan_embeddings(
        {"model": "m", "input": [embedding_text(5), embedding_text(6)]}, DEFAULT_TEMPLATE, 16
    )
    assert [path for path, _ in plan.calls] == ["/v1/chat/completions"] * 2
    assert [orjson.loads(embedding_chat_body("m", i)) for i in (5, 6)] == [
        document for _, document in plan.calls
    ]  # the proxy adds only the flag on its way to vLLM


def test_a_whole_answer_is_checked_item_by_item() -> None:
    assert check_embeddings(answer(3), 3) == HIDDEN
    with pytest.raises(BenchError, match="2 items in 'data' for 3 inputs"):
        check_embeddings(answer(2), 3)
    swapped = answer(2)
    swapped["data"].reverse()
    with pytest.raises(BenchError, match="item 0 has index 1"):
        check_embeddings(swapped, 2)
    uneven = answer(2)
    uneven["data"][1]["embedding"] = [0.5] * (HIDDEN + 1)
    with pytest.raises(BenchError, match="different lengths"):
        check_embeddings(uneven, 2)
    text = answer(1)
    text["data"][0]["embedding"] = "AAAA"  # base64: not what the bench asked for
    with pytest.raises(BenchError, match="no float vector"):
        check_embeddings(text, 1)
    with pytest.raises(BenchError, match=re.escape("no 'data' list in the answer: {'error': 'x'}")):
        check_embeddings({"error": "x"}, 1)


def test_vectors_are_counted_without_a_parse() -> None:
    for count in (0, 1, 16, 256):
        assert embeddings_in(orjson.dumps(answer(count))) == count


def test_only_a_refusal_of_the_path_makes_the_phase_unsupported() -> None:
    assert probe_problem(200, b"{}") is None
    assert probe_problem(404, b'{"detail":"Not Found"}') == (
        'the proxy answered 404: {"detail":"Not Found"}'
    )
    assert probe_problem(400, b"no embeddings here") is not None
    for status in (401, 403, 429, 500, 502):
        with pytest.raises(BenchError, match=f"HTTP {status}"):
            probe_problem(status, b"")
    with pytest.raises(BenchError, match="--api-key"):
        probe_problem(401, b"")


def test_the_api_key_goes_to_the_proxy_routes_only() -> None:
    for found in (
        routes(VLLM, PROXY, "http://nginx", "k"),
        stream_routes(VLLM, PROXY, "k"),
        load_routes(VLLM, PROXY, "k"),
        embeddings_routes(VLLM, PROXY, "k"),
    ):
        assert found, found
        for route in found:
            assert route.api_key == ("k" if route.base_url == PROXY else None), route
            assert "'k'" not in repr(route)  # never in a traceback or log line
    assert all(route.api_key is None for route in routes(VLLM, PROXY, None))


def test_a_client_with_a_key_sends_it_as_a_bearer_token() -> None:
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={})

    async def main() -> None:
        transport = httpx.MockTransport(handler)
        for key in ("s3cret", None):
            async with new_client(PROXY, 1, key, transport=transport) as client:
                await client.post("/v1/embeddings", content=b"{}")

    anyio.run(main)
    assert seen[0]["authorization"] == "Bearer s3cret"
    assert "authorization" not in seen[1]
    assert seen[1]["content-type"] == "application/json"


class FakeStack:
    """The proxy's /v1/embeddings and vLLM's chat endpoint, counting what they get."""

    def __init__(self, embeddings_status: int = 200, short_after: int | None = None) -> None:
        self.embeddings_status = embeddings_status
        #: After this many embeddings requests, answer one vector short.
        self.short_after = short_after
        self.batches: list[int] = []
        self.texts: list[str] = []
        self.chats = 0
        self.in_flight = 0
        self.peak = 0
        self.authorization: Counter[tuple[str, str | None]] = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.authorization[(host, request.headers.get("authorization"))] += 1
        document = orjson.loads(request.content)
        if host == "proxy":
            assert request.url.path == "/v1/embeddings"
            if self.embeddings_status != 200:
                return httpx.Response(self.embeddings_status, json={"detail": "Not Found"})
            self.batches.append(len(document["input"]))
            self.texts.extend(document["input"])
            count = len(document["input"])
            if self.short_after is not None and len(self.batches) > self.short_after:
                count -= 1
            return httpx.Response(200, content=orjson.dumps(answer(count)))
        assert (host, request.url.path) == ("vllm", "/v1/chat/completions")
        assert "kv_transfer_params" not in document  # the baseline is unflagged
        self.texts.append(document["messages"][0]["content"])
        self.chats += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await anyio.sleep(0.001)
        self.in_flight -= 1
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}]})


def run_phase(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeStack,
    batches: tuple[int, ...],
    rounds: int,
    per_round: Callable[[int], int],
    cpu: Callable[[], float] | None = None,
    limit: int = 64,
) -> tuple[list[EmbeddingsArm], str]:
    transport = httpx.MockTransport(fake)
    monkeypatch.setattr(
        bench_embeddings,
        "new_client",
        functools.partial(bench_client.new_client, transport=transport),
    )
    stream = io.StringIO()

    async def main() -> list[EmbeddingsArm]:
        return await measure_embeddings(
            embeddings_routes(VLLM, PROXY, "key"),
            "m",
            batches,
            rounds,
            per_round,
            Progress(stream),
            cpu,
            first_index=0,
            limit=limit,
        )

    return anyio.run(main), stream.getvalue()


def test_the_phase_interleaves_both_arms_at_every_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeStack()
    clock = iter(float(i) for i in range(1000))
    arms, _ = run_phase(
        monkeypatch, fake, (1, 16, 40), 3, lambda b: 2 if b == 1 else 1, lambda: next(clock), 8
    )
    proxy, direct = arms
    assert (proxy.name, direct.name) == (EMBEDDINGS_PROXY, EMBEDDINGS_DIRECT)
    assert proxy.status == direct.status == "ok" and proxy.hidden_size == HIDDEN
    for arm in arms:
        assert [p.batch_size for p in arm.points] == [1, 16, 40]
        for point, requests in zip(arm.points, (6, 3, 3), strict=True):
            assert point.requests == requests and point.latency_ms.n == requests
            assert point.inputs == requests * point.batch_size
            assert len(point.rounds_ips) == 3 and point.inputs_per_second > 0
            assert point.requests_per_second == pytest.approx(
                point.inputs_per_second / point.batch_size
            )
    # Probe (1 input), then per batch size one warm-up and the rounds' requests.
    assert fake.batches == [1, 1, *[1] * 6, 16, *[16] * 3, 40, *[40] * 3]
    assert fake.chats == (1 + 6) + (16 + 3 * 16) + (40 + 3 * 40)
    assert fake.peak <= 8  # the direct arm keeps at most `limit` chats in flight
    assert len(set(fake.texts)) == len(fake.texts)  # every input a text of its own
    assert fake.authorization == {
        ("proxy", "Bearer key"): len(fake.batches),
        ("vllm", None): fake.chats,
    }
    # Two readings of the (fake) CPU clock around each of the proxy's turns: 1 s a turn.
    assert [p.proxy_cpu_ms_per_input for p in proxy.points] == pytest.approx(
        [1e3 * 3 / 6, 1e3 * 3 / 48, 1e3 * 3 / 120]
    )
    assert all(p.proxy_cpu_ms_per_input is None for p in direct.points)


def test_a_proxy_without_embeddings_marks_the_phase_unsupported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeStack(embeddings_status=404)
    (proxy, direct), said = run_phase(monkeypatch, fake, (1, 16), 2, lambda b: 1)
    assert proxy.status == "unsupported" and "404" in proxy.note and not proxy.points
    assert direct.status == "skipped" and not direct.points
    assert fake.chats == 0 and "embeddings: unsupported" in said


def test_a_wrong_count_of_vectors_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeStack(short_after=2)  # the probe and the warm-up are whole, then one short
    with pytest.raises(BenchError, match="embeddings_proxy: 15 vectors for 16 inputs"):
        run_phase(monkeypatch, fake, (16,), 1, lambda b: 2)


def test_a_short_warm_up_answer_is_caught_by_the_whole_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeStack(short_after=1)
    with pytest.raises(BenchError, match="15 items in 'data' for 16 inputs"):
        run_phase(monkeypatch, fake, (16,), 1, lambda b: 2)


def test_fan_out_stops_at_the_first_failure() -> None:
    calls = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        number = calls
        await anyio.sleep(0.001)
        return httpx.Response(503 if number == 3 else 200, text="busy")

    async def main() -> None:
        async with new_client(VLLM, 4, transport=httpx.MockTransport(handler)) as client:
            await fan_out(client, [b"{}"] * 50, 4, "chat")

    with pytest.raises(BenchError, match="chat: HTTP 503: busy"):
        anyio.run(main)
    assert calls < 50


def test_skipped_arms_name_both_and_serialise() -> None:
    arms = skipped_arms("--no-embeddings")
    assert [(a.name, a.status, a.note) for a in arms] == [
        (EMBEDDINGS_PROXY, "skipped", "--no-embeddings"),
        (EMBEDDINGS_DIRECT, "skipped", "--no-embeddings"),
    ]
    assert json.dumps([a.kind for a in arms]) == '["embeddings", "embeddings"]'
