"""Waiting for a flagged request's hidden state to appear in the shared-memory ring."""

from __future__ import annotations

import time
from typing import Protocol

import anyio

#: First poll interval after a miss, and the cap it doubles up to (seconds).
FIRST_BACKOFF = 50e-6
MAX_BACKOFF = 5e-3


class VectorRecord(Protocol):
    """What the proxy needs from ``ring.Record``."""

    @property
    def key(self) -> bytes: ...

    def as_floats(self) -> list[float]: ...


class VectorSource(Protocol):
    """What the proxy needs from ``ring.RingDirectory`` (tests may pass a fake)."""

    def has_ring(self) -> bool: ...

    def lookup(self, key: bytes) -> VectorRecord | None: ...

    def publish_count(self) -> int: ...

    def min_slot_count(self) -> int | None: ...

    def close(self) -> None: ...


def overwritten_since(source: VectorSource, published_before: int) -> bool:
    """True if enough records were published since ``published_before`` to reuse every slot.

    Then a record published after that point may already be gone (FIFO overwrite); waiting
    longer cannot bring it back.
    """
    slots = source.min_slot_count()
    return slots is not None and source.publish_count() - published_before >= slots


def _matching(source: VectorSource, key: bytes) -> VectorRecord | None:
    record = source.lookup(key)
    if record is None or record.key != key:  # a record for another key is never ours
        return None
    return record


async def wait_for_vector(
    source: VectorSource, key: bytes, timeout: float, published_before: int | None = None
) -> tuple[VectorRecord | None, float]:
    """Look ``key`` up until it appears or ``timeout`` seconds pass.

    Returns the record (``None`` on timeout) and the seconds spent waiting. The first lookup is
    immediate (the worker usually published during prefill, long before vLLM answered); after
    that the poll interval doubles from ``FIRST_BACKOFF`` to ``MAX_BACKOFF``.
    """
    start = time.monotonic()
    record = _matching(source, key)
    if record is not None:
        return record, 0.0
    if published_before is not None and overwritten_since(source, published_before):
        return None, 0.0
    deadline = start + timeout
    delay = FIRST_BACKOFF
    while True:
        now = time.monotonic()
        if now >= deadline:
            return None, now - start
        await anyio.sleep(min(delay, deadline - now))
        record = _matching(source, key)
        if record is not None:
            return record, time.monotonic() - start
        delay = min(delay * 2, MAX_BACKOFF)
