"""The loop the phases share (bench/turns.py): the round-robin order of turns, the loop
itself, and bursts against fake servers."""

from __future__ import annotations

import io
import itertools
from collections import Counter

import anyio
import httpx
import pytest

from tests.bench.fakes import FakeServers
from vllm_hidden_state_proxy.bench.client import BenchError, Route, chat_request
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.turns import burst, round_robin, take_turns


def test_every_round_gives_every_arm_one_turn_and_rotates_who_goes_first() -> None:
    order = list(round_robin(["a", "b", "c"], 4))
    assert order == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip


def test_each_arm_gets_exactly_rounds_turns_and_each_position_evens_out() -> None:
    arms = ["direct", "passthrough", "flagged", "base64", "stream"]
    order = list(round_robin(arms, 10))
    assert Counter(arm for _, arm in order) == dict.fromkeys(arms, 10)
    positions: dict[str, Counter[int]] = {arm: Counter() for arm in arms}
    for index, (_, arm) in enumerate(order):
        positions[arm][index % len(arms)] += 1
    for counts in positions.values():  # every arm went first, second... equally often
        assert set(counts.values()) == {2}


def test_no_arm_runs_twice_in_a_row_across_round_boundaries_with_three_or_more_arms() -> None:
    order = [arm for _, arm in round_robin(["x", "y", "z"], 6)]
    assert all(a != b for a, b in itertools.pairwise(order))


def test_degenerate_inputs() -> None:
    assert list(round_robin([], 3)) == []
    assert list(round_robin(["only"], 3)) == [(0, "only"), (1, "only"), (2, "only")]
    assert list(round_robin(["a", "b"], 0)) == []
    assert [arm for _, arm in round_robin([1, 2, 3], 5)][12:] == [2, 3, 1]  # round 4 as round 1


def test_a_burst_sends_exactly_count_requests_with_at_most_concurrency_in_flight() -> None:
    fake = FakeServers()
    stack = fake.stack()
    route = stack.via_proxy("flagged", "", "float")

    async def main() -> tuple[float, list[float]]:
        async with stack.client(route, 4) as client:
            chats = stack.chat_request(client, route, itertools.count())
            return await burst(chats, "flagged", 23, 4)

    seconds, latencies = anyio.run(main)
    assert len(latencies) == len(fake.seen) == 23 and seconds > 0
    assert len({str(document["messages"]) for _, _, document in fake.seen}) == 23
    assert fake.peak <= 4


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
        (httpx.Response(200, text="{}"), "a flagged answer without its vector"),
    ],
)
def test_a_failing_request_stops_the_burst_with_a_clear_error(
    response: httpx.Response, message: str
) -> None:
    async def main() -> None:
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(base_url="http://f", transport=transport) as client:
            chats = chat_request(client, "flagged", itertools.repeat(b"{}"), vector=True)
            await burst(chats, "flagged", 50, 8)

    with pytest.raises(BenchError, match=message) as caught:
        anyio.run(main)
    assert "flagged at concurrency 8" in str(caught.value)


def _run(fake: FakeServers, rounds: int, warm_up_rounds: int = 0) -> list[tuple[str, int]]:
    """``take_turns`` over a direct and a proxy arm, a chat a turn; the turns taken, each
    counted on the task. Every client is closed, also when a turn fails."""
    stack = fake.stack()
    indices = itertools.count()
    clients: list[httpx.AsyncClient] = []
    turns: list[tuple[str, int]] = []

    def client(route: Route) -> httpx.AsyncClient:
        clients.append(stack.client(route))
        return clients[-1]

    async def warm_up(client: httpx.AsyncClient, route: Route) -> None:
        await stack.chat_request(client, route, indices)()

    async def turn(client: httpx.AsyncClient, route: Route, number: int) -> int:
        turns.append((route.name, number))
        await stack.chat_request(client, route, indices)()
        return 1

    async def main() -> None:
        arms = [stack.direct("a", ""), stack.via_proxy("b", "")]
        task = Progress(io.StringIO()).task("turns", 2 * rounds)
        try:
            await take_turns(
                arms, client, turn, rounds, task, warm_up=warm_up, warm_up_rounds=warm_up_rounds
            )
        finally:
            assert len(clients) == 2 and all(opened.is_closed for opened in clients)
        assert task.count == len(turns)

    anyio.run(main)
    return turns


def test_the_arms_warm_up_then_take_their_turns() -> None:
    fake = FakeServers()
    assert _run(fake, 2, warm_up_rounds=2) == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    warm_up = ["vllm", "proxy", "proxy", "vllm"]  # the rounds of warm-up rotate too
    assert [host for host, _, _ in fake.seen] == [*warm_up, "vllm", "proxy", "proxy", "vllm"]


def test_a_failed_turn_stops_the_loop_and_every_client_is_closed() -> None:
    with pytest.raises(BenchError, match="HTTP 503"):
        _run(FakeServers(failing=3), 3)  # the first turn of round 1
