"""Round-robin order of interleaved runs (bench/interleave.py)."""

from __future__ import annotations

import itertools
from collections import Counter

from vllm_hidden_state_proxy.bench.interleave import rotated, round_robin


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
    assert rotated([1, 2, 3], 4) == [2, 3, 1]
    assert rotated([], 2) == []
