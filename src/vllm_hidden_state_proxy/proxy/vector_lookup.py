"""A flagged request against the rings: before it is sent, whether they can serve it and in
which absolute layers (:func:`check_rings`, :func:`resolve_layers`); once vLLM has answered, its
record in them (:func:`wait_for_record`).

The hook publishes a record before the step's output leaves the worker, so by the time vLLM's
answer (or its first streamed chunk) reaches the proxy, the record is in its engine's ring: the
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
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import anyio

import vllm_hidden_state_proxy.proxy.vector_memory as vector_memory
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    MATRIX_POOLINGS,
    MAX_RECORD_MIB_ENV,
)
from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    bad_request,
    engines_without_ring,
    hook_error,
    no_ring,
    ring_directory_refused,
    rings_of_other_models,
    vector_overwritten,
    vector_timeout,
)
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.types import (
    KV,
    LAYERS,
    RingSource,
    VectorRequest,
    WantedVectors,
    is_int,
    is_token_ids,
)
from vllm_hidden_state_proxy.proxy.vector_memory import off_loop_limiter
from vllm_hidden_state_proxy.request_fields import RequestFieldError
from vllm_hidden_state_proxy.ring import (
    ErrorRecord,
    Found,
    PendingRows,
    PublishMarks,
    Record,
    RingShape,
)
from vllm_hidden_state_proxy.ring.layout import arena_block_size
from vllm_hidden_state_proxy.ring.records import matrix_bytes
from vllm_hidden_state_proxy.wanted_vectors import resolve_layers as wanted_layers

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
    records, when vLLM's answer ended: they are published after it). With ``error_key`` (the
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


class EarlyCapture:
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
        self._task: asyncio.Task[None] | None = None

    async def during(self, work: Awaitable[T]) -> T:
        """Await ``work``; from ``EARLY_DELAY`` on, look for the record beside it."""
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
                    # Copied now: the arena may be written over before the answer ends.
                    try:
                        self.found = await _loaded(found)
                    except ProxyError:  # refused: the lookup after the answer says so
                        return
                    self.counted = True
                return
            if self.rings.overwritten_since(self.marks):
                return
            await asyncio.sleep(EARLY_INTERVAL)


# ---------------------------------------------------------------------------------------------
# Before a flagged request is sent
# ---------------------------------------------------------------------------------------------


def check_rings(rings: RingSource, ring_dir: str) -> tuple[RingShape, ...]:
    """The live rings' shapes, before a flagged request is sent; 503 if there are none (naming
    why the directory is refused, if it is), or if they are of different models (servers of two
    models sharing the directory: the worker hook refuses the second, unless both started before
    either saw the other's ring)."""
    shapes = rings.live_shapes() if rings.has_ring() else ()
    if not shapes:
        refusal = rings.refusal()
        if refusal is not None:  # nothing in it is read: its notes could be anyone's
            raise ring_directory_refused(refusal)
        failures = rings.failed_engines()
        raise engines_without_ring(failures) if failures else no_ring(ring_dir)
    if any(shape.model_dims != shapes[0].model_dims for shape in shapes[1:]):
        raise rings_of_other_models(shapes, ring_dir)
    return shapes


def resolve_layers(
    request: VectorRequest, shapes: Sequence[RingShape], param: str = f"{KV}.{LAYERS}"
) -> WantedVectors:
    """Absolute layer indices for ``request`` on rings of ``shapes`` (at least one).

    Raises 400 listing the captured layers for a layer the server does not capture.
    """
    captured = set(shapes[0].layers)
    for other in shapes[1:]:
        captured &= set(other.layers)
    try:
        return wanted_layers(request, shapes[0].num_hidden_layers, captured, param)
    except RequestFieldError as refused:
        raise bad_request(refused.message, refused.param) from None


def check_matrix_room(
    document: dict[str, Any], wanted: WantedVectors, shapes: Sequence[RingShape]
) -> None:
    """Before a matrix pooling is sent: 503 if the server carries no matrices; for
    ``"all_answer"`` with ``max_tokens`` (or ``max_completion_tokens``), 413 if that many rows
    would be more than one request may take. (Without it, the hook decides with vLLM's own
    default, and an ``"all_prompt"`` prompt's length is known only in vLLM.)"""
    pooling = wanted.request.record_pooling
    if pooling not in MATRIX_POOLINGS:
        return
    if any(shape.arena_size == 0 for shape in shapes):
        raise ProxyError(
            503,
            f"This vLLM server carries no matrices (pooling {pooling!r}): its worker hook runs "
            f"with {ARENA_MIB_ENV}=0. Restart it with an arena.",
        )
    _check_vectors_bound(document, wanted, shapes)
    if wanted.request.pooling != "all_answer":
        return
    limits = [document.get(name) for name in ("max_completion_tokens", "max_tokens")]
    rows = next((value for value in limits if is_int(value)), None)
    if rows is None:
        return
    limit = min(shape.max_record for shape in shapes)
    size = matrix_bytes(rows, len(wanted.distinct_layers), shapes[0].hidden_size)
    if arena_block_size(size) > limit:  # the hook's max record counts the block's header
        param = "max_completion_tokens" if is_int(limits[0]) else "max_tokens"
        raise ProxyError(
            413,
            f"An all_answer matrix of up to {rows} rows x {len(wanted.distinct_layers)} layers "
            f"x {shapes[0].hidden_size} float32 takes {size / (1 << 20):.1f} MiB, more than one "
            f"request may ({MAX_RECORD_MIB_ENV}={limit >> 20} in vLLM's environment): ask for "
            f"fewer tokens or layers.",
            param,
        )


def _check_vectors_bound(
    document: dict[str, Any], wanted: WantedVectors, shapes: Sequence[RingShape]
) -> None:
    """413 before sending if the request's matrices, as far as their size is known now, are
    more than ``--max-vectors-size``: ``"all_answer"`` with ``max_tokens`` (times ``n``), and
    ``"all_prompt"`` of token-id prompts; either times the prompts of a completions list. (The
    rows of a text prompt are known only in vLLM: those are counted as they arrive.)"""
    share = vector_memory.current()
    if share is None:
        return
    pooling = wanted.request.pooling
    prompt = document.get("prompt")
    prompts: list[Any] = [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = prompt
    if pooling == "all_answer":
        limits = [document.get(name) for name in ("max_completion_tokens", "max_tokens")]
        rows = next((value for value in limits if is_int(value)), None)
        n = document.get("n")
        choices = n if is_int(n) and n > 0 else 1
        if rows is None:
            return
        total_rows = rows * choices * len(prompts)
        param = "max_completion_tokens" if is_int(limits[0]) else "max_tokens"
    elif pooling == "all_prompt" and all(is_token_ids(ids) for ids in prompts):
        total_rows = sum(len(ids) for ids in prompts)
        param = "prompt"
    else:
        return
    size = matrix_bytes(total_rows, len(wanted.distinct_layers), shapes[0].hidden_size)
    if size > share.memory.per_request:
        raise share.refuse(size, param)
