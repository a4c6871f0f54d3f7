"""A flagged request's record in the rings, once vLLM has replied (:func:`wait_for_record`);
what was checked before sending it is :mod:`.plan`'s.

The hook publishes a record before the step's output leaves the worker, so by the time vLLM's
reply (or its first streamed chunk) reaches the proxy, the record is in its engine's ring: the
first lookup normally finds it. When it does not:

- an engine of this vLLM has a failure note (its hook could not start): the request may have
  landed there, and waiting cannot help: 503 at once, naming the engine and the cause;
- a ring reused every slot since the request was sent: the record may be overwritten: 504 at
  once, saying to raise the slot count;
- otherwise the lookup is repeated with a growing interval until ``--vector-timeout``: 504.

An error record (the hook could not produce this request's vectors) is an error with its
message and its status: 502 (the hook failed), 413 (a matrix larger than one request may take),
503 (the engine's arena is busy, or was written over before the proxy read it).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import anyio

import vllm_hidden_state_proxy.proxy.vectors.memory as vector_memory
from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    engines_without_ring,
    hook_error,
    vector_overwritten,
    vector_timeout,
)
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.state import RingSource
from vllm_hidden_state_proxy.proxy.vectors.memory import off_loop_limiter
from vllm_hidden_state_proxy.ring import (
    ErrorRecord,
    Found,
    PendingRows,
    PublishMarks,
    Record,
)

T = TypeVar("T")


#: First poll interval after a miss, and the cap it doubles up to (seconds).
FIRST_BACKOFF = 50e-6
MAX_BACKOFF = 5e-3
#: While a response is still being generated: first look after this long, then at this interval.
EARLY_DELAY = 0.05
EARLY_INTERVAL = 0.02


def _matching(
    rings: RingSource, key: bytes, error_key: bytes | None = None
) -> Found | PendingRows | None:
    """The record of ``key``; else, with ``error_key``, an error record published under it."""
    found = rings.find(key)
    if found is not None and found.key == key:  # a record for another key is never ours
        return found
    if error_key is None:
        return None
    failed = rings.lookup(error_key)
    if isinstance(failed, ErrorRecord) and failed.key == error_key:
        return failed
    return None


async def _loaded(found: Found | PendingRows) -> Found:
    """``found`` with its rows, counted against the request's memory for vectors: a large
    matrix before its rows are copied (413/503 instead of the copy), and copied and checked in
    a thread, off the event loop; a small record as it is (it is already copied)."""
    if isinstance(found, PendingRows):
        vector_memory.take(found.size)
        loaded = await anyio.to_thread.run_sync(found.load, limiter=off_loop_limiter())
        if isinstance(loaded, ErrorRecord):
            vector_memory.give_back(found.size)
        return loaded
    if isinstance(found, Record):
        vector_memory.take(len(found.vectors))
    return found


async def _as_record(found: Found | PendingRows, counted: bool = False) -> Record:
    """The record (loaded and counted unless ``counted``); its error as a ``ProxyError``."""
    if not counted:
        found = await _loaded(found)
    if isinstance(found, ErrorRecord):
        raise hook_error(found.message, found.status)
    if isinstance(found, PendingRows):  # pragma: no cover - counted ones are loaded
        return await _as_record(found)
    return found


async def wait_for_record(
    rings: RingSource,
    key: bytes,
    marks: PublishMarks,
    timeout: float,
    metrics: ProxyMetrics,
    early: Found | PendingRows | None = None,
    error_key: bytes | None = None,
    early_counted: bool = False,
) -> Record:
    """The request's record (``early`` if already captured); ``ProxyError`` if there is none.

    ``marks`` are the rings' publish counters when the request was sent (for an answer's
    records, when vLLM's reply ended: they are published after it). With ``error_key`` (the
    request key of an answer's record key), an error record under it answers too.
    """
    start = time.monotonic()
    found = early if early is not None else _matching(rings, key, error_key)
    if found is None:
        failures = rings.failed_engines()
        if failures:
            metrics.vector_misses["engine_without_ring"] += 1
            raise engines_without_ring(failures)
        found = await _poll(rings, key, marks, start + timeout, error_key)
    if found is None:
        if rings.overwritten_since(marks):
            metrics.vector_misses["overwritten"] += 1
            raise vector_overwritten(rings.smallest_slot_count())
        metrics.vector_misses["not_published"] += 1
        raise vector_timeout(timeout)
    metrics.vector_wait.observe(time.monotonic() - start)
    return await _as_record(found, counted=early_counted and found is early)


async def _poll(
    rings: RingSource,
    key: bytes,
    marks: PublishMarks,
    deadline: float,
    error_key: bytes | None = None,
) -> Found | PendingRows | None:
    """Look again with a doubling interval, until found, overwritten or ``deadline``."""
    delay = FIRST_BACKOFF
    while not rings.overwritten_since(marks):
        now = time.monotonic()
        if now >= deadline:
            return None
        await asyncio.sleep(min(delay, deadline - now))
        found = _matching(rings, key, error_key)
        if found is not None:
            return found
        delay = min(delay * 2, MAX_BACKOFF)
    return None


class _EarlyLookup(ABC):
    """Runs :meth:`poll` beside a reply still being generated, from ``EARLY_DELAY`` on: the
    timer and the task that :class:`EarlyCapture` and :class:`EarlyRecords` share."""

    _task: asyncio.Task[None] | None = None

    @abstractmethod
    async def poll(self) -> None:
        """Look in the rings until done; return quietly on ring trouble."""

    async def during(self, work: Awaitable[T]) -> T:
        """Await ``work``; from ``EARLY_DELAY`` on, look for the record(s) beside it."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(EARLY_DELAY, self._start)
        try:
            return await work
        finally:
            timer.cancel()
            if self._task is not None:
                self._task.cancel()

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.poll())


class EarlyCapture(_EarlyLookup):
    """Picks a record up while its (long) generation is still running.

    The worker publishes at prefill; a response with many output tokens completes much later,
    and meanwhile other flagged prefills advance the rings. Taking the record early means its
    slot cannot be reused before the proxy reads it. Short requests never start it: only a
    timer is set (a task per request would be a good part of a short request's cost), and they
    finish first and look the record up directly (:func:`wait_for_record`).
    """

    def __init__(self, rings: RingSource, key: bytes, marks: PublishMarks) -> None:
        self.rings = rings
        self.key = key
        self.marks = marks
        self.found: Found | PendingRows | None = None
        #: ``found`` was loaded and counted here (see :func:`_loaded`).
        self.counted = False

    async def poll(self) -> None:
        """Look every ``EARLY_INTERVAL`` until found, or until the rings have moved past it."""
        while True:
            try:
                found = _matching(self.rings, self.key)
            except Exception:  # the direct lookup afterwards reports ring trouble
                return
            if found is not None:
                self.found = found
                if isinstance(found, PendingRows):
                    # Copied now: the arena may be written over before the reply ends.
                    try:
                        self.found = await _loaded(found)
                    except ProxyError:  # refused: the lookup after the reply says so
                        return
                    self.counted = True
                return
            if self.rings.overwritten_since(self.marks):
                return
            await asyncio.sleep(EARLY_INTERVAL)


class EarlyRecords(_EarlyLookup):
    """Picks up the records of several keys while one long reply is still running (a prompt
    list sent as one request, whose prompts publish at their prefills): as
    :class:`EarlyCapture`, but one task looks for every key not found yet. Records only (a
    matrix's rows are not taken early: those lists fan out)."""

    def __init__(self, rings: RingSource, keys: Sequence[bytes], marks: PublishMarks) -> None:
        self.rings = rings
        self.keys = list(keys)
        self.marks = marks
        self.found: dict[bytes, Found] = {}

    async def poll(self) -> None:
        """Look until every key is found or the rings have moved past the marks; less often
        the more keys are left (a lookup each)."""
        while True:
            pending = [key for key in self.keys if key not in self.found]
            if not pending:
                return
            try:
                for key in pending:
                    found = _matching(self.rings, key)
                    if isinstance(found, (Record, ErrorRecord)):
                        self.found[key] = found
                if self.rings.overwritten_since(self.marks):
                    return
            except Exception:  # the direct lookup afterwards reports ring trouble
                return
            await asyncio.sleep(EARLY_INTERVAL * max(1, len(pending) // 16))
