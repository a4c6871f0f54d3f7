"""Round-robin order for interleaved runs: every arm gets one turn per round, and the arm that
goes first rotates from round to round, so slow drifts of the machine (another process waking
up, caches, the CPU clock) fall on every arm alike instead of on whichever ran last."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], offset: int) -> list[T]:
    """``items`` rotated left by ``offset`` (modulo its length)."""
    if not items:
        return []
    shift = offset % len(items)
    return [*items[shift:], *items[:shift]]


def round_robin(arms: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round, arm)`` for ``rounds`` rounds; round ``r`` starts with arm ``r % len(arms)``."""
    for number in range(rounds):
        for arm in rotated(arms, number):
            yield number, arm
