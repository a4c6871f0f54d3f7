"""Waiting for a flagged request's hidden state to appear in the shared-memory ring."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

import anyio

#: First poll interval after a miss, and the cap it doubles up to (seconds).
FIRST_BACKOFF = 50e-6
MAX_BACKOFF = 5e-3
#: While a response is still being generated: first look after this long, then at this interval.
EARLY_DELAY = 0.05
EARLY_INTERVAL = 0.02


class VectorRecord(Protocol):
    """What the proxy needs from ``ring.Record``."""

    @property
    def key(self) -> bytes: ...

    @property
    def vector(self) -> bytes: ...  # little-endian float32

    @property
    def hidden_size(self) -> int: ...

    @property
    def position(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def as_floats(self) -> list[float]: ...


class VectorSource(Protocol):
    """What the proxy needs from ``ring.RingDirectory`` (tests may pass a fake)."""

    def has_ring(self) -> bool: ...

    def lookup(self, key: bytes) -> VectorRecord | None: ...

    def publish_count(self) -> int: ...

    def min_slot_count(self) -> int | None: ...

    def hidden_size(self) -> int | None: ...

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


class VectorWait(NamedTuple):
    """How the wait for one vector ended."""

    record: VectorRecord | None
    #: Seconds from the first lookup until the record was found (or the wait gave up).
    waited: float
    #: On a miss: the ring reused every slot since the request was forwarded, so the record
    #: may have been overwritten (waiting longer cannot bring it back).
    overwritten: bool = False


async def wait_for_vector(
    source: VectorSource, key: bytes, timeout: float, published_before: int | None = None
) -> VectorWait:
    """Look ``key`` up until it appears, its slot is known to be reused, or ``timeout`` passes.

    The first lookup is immediate (the worker publishes during prefill, long before vLLM
    answers); after that the poll interval doubles from ``FIRST_BACKOFF`` to ``MAX_BACKOFF``.
    ``published_before`` is the ring's publish counter when the request was forwarded.
    """

    def overwritten() -> bool:
        return published_before is not None and overwritten_since(source, published_before)

    start = time.monotonic()
    record = _matching(source, key)
    if record is not None:
        return VectorWait(record, 0.0)
    if overwritten():
        return VectorWait(None, 0.0, overwritten=True)
    deadline = start + timeout
    delay = FIRST_BACKOFF
    while True:
        now = time.monotonic()
        if now >= deadline:
            return VectorWait(None, now - start, overwritten=overwritten())
        await anyio.sleep(min(delay, deadline - now))
        record = _matching(source, key)
        if record is not None:
            return VectorWait(record, time.monotonic() - start)
        delay = min(delay * 2, MAX_BACKOFF)


class EarlyCapture:
    """Picks a vector up while its (long) generation is still running.

    The worker publishes at prefill; a response with many output tokens completes much later,
    and meanwhile other flagged prefills advance the ring. Taking the record early means its
    slot cannot be reused before the proxy reads it. Short requests never get past the first
    sleep: they finish first and look the vector up directly (``wait_for_vector``).
    """

    def __init__(self, source: VectorSource, key: bytes, published_before: int) -> None:
        self.source = source
        self.key = key
        self.published_before = published_before
        self.record: VectorRecord | None = None

    async def run(self) -> None:
        await anyio.sleep(EARLY_DELAY)
        while True:
            try:
                record = _matching(self.source, self.key)
            except Exception:  # the direct lookup afterwards reports ring trouble
                return
            if record is not None:
                self.record = record
                return
            if overwritten_since(self.source, self.published_before):
                return
            await anyio.sleep(EARLY_INTERVAL)


async def capturing_early(
    source: VectorSource, key: bytes, published_before: int, work: Callable[[], Awaitable[None]]
) -> VectorRecord | None:
    """Run ``work`` (which must not raise) with an :class:`EarlyCapture` beside it; the record
    if it was captured meanwhile."""
    capture = EarlyCapture(source, key, published_before)
    async with anyio.create_task_group() as group:
        group.start_soon(capture.run)
        await work()
        group.cancel_scope.cancel()
    return capture.record
