"""The memory vectors and matrices take in one proxy process, bounded like request bodies.

What counts (``--max-vectors-size`` per client request, ``--vectors-budget`` per process):

- every record taken out of a ring (its rows, copied out of the mapping), from before the copy
  (a matrix's size is in its slot) until the response to the request has been sent;
- the encoded response built around them: the whole body for one sent in one piece, or
  the pieces in flight (two of about 1 MiB) for one sent in pieces (:mod:`..replies`).

A request whose records would go over its own bound gets 413 naming ``--max-vectors-size``;
one that would take the process over ``--vectors-budget`` gets 503 (retry). Nothing waits for
room: a request either fits now or is answered at once. Where the size is known before vLLM
runs (``"all_answer"`` with ``max_tokens``, a list of token-id prompts with ``"all_prompt"``),
the per-request bound refuses it before sending (:func:`.plan.check_matrix_room`).
A reply with vectors is sent within a deadline (:class:`..replies.SendDeadline`), so a slow client
holds its share for a bounded time. ``/metrics`` shows the bytes held, the refusals and the
cuts (:mod:`.metrics`).

The share of the current request rides in a context variable set by the endpoint
(:func:`sharing`), so the lookups deep inside an exchange (and the tasks of a fan-out, which
copy the context) charge the same share without passing it down every call.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
from starlette.types import Scope

from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    vectors_budget_exhausted,
    vectors_too_large,
)
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics

#: Records and responses at least this large are copied, checked and encoded off the event loop.
OFF_LOOP_BYTES = 256 * 1024
#: Threads that do that work at once, per process (each holds one record's work).
OFF_LOOP_THREADS = 4
#: The key of the ASGI scope's extension that cuts the client's connection at once, dropping
#: what is buffered for it (set by the proxy's uvicorn protocol, ``http_protocol.py``).
CUT_EXTENSION = "hidden_state_proxy.cut"

_LIMITER: anyio.CapacityLimiter | None = None


def off_loop_limiter() -> anyio.CapacityLimiter:
    """The process's bound on threads doing vector work (made on first use, in the loop)."""
    global _LIMITER
    if _LIMITER is None:
        _LIMITER = anyio.CapacityLimiter(OFF_LOOP_THREADS)
    return _LIMITER


class VectorMemory:
    """The vector bytes one proxy process holds at once, over all its requests; with
    ``metrics``, what it holds and refuses is shown on ``/metrics``."""

    def __init__(self, total: int, per_request: int, metrics: ProxyMetrics | None = None) -> None:
        self.total = total
        self.per_request = per_request
        self.metrics = metrics or ProxyMetrics()
        self.held = 0
        self.metrics.vector_bytes = 0  # a row taken over from a dead worker held its bytes
        #: The most ever held at once (for tests).
        self.peak = 0

    def _changed(self) -> None:
        self.metrics.vector_bytes = self.held

    def share(
        self, send_timeout: float | None = None, cut: Callable[[], None] | None = None
    ) -> VectorShare:
        return VectorShare(self, send_timeout, cut)


class VectorShare:
    """One client request's part of a :class:`VectorMemory`; given back on exit."""

    __slots__ = ("cut", "memory", "refused", "send_timeout", "taken")

    def __init__(
        self,
        memory: VectorMemory,
        send_timeout: float | None = None,
        cut: Callable[[], None] | None = None,
    ) -> None:
        self.memory = memory
        self.taken = 0
        #: Each send of the request's JSON response must complete within this (``None``: no bound).
        self.send_timeout = send_timeout
        #: Cuts the client's connection (from the server, when it offers it; see CUT_EXTENSION).
        self.cut = cut
        #: A refusal was counted (the lookups of a fan-out may each be refused: one request).
        self.refused = False

    def _refusal(self, reason: str) -> None:
        if not self.refused:
            self.refused = True
            self.memory.metrics.vector_refusals[reason] += 1

    def take(self, size: int) -> None:
        """Count ``size`` more bytes; 413 past the request's bound, 503 past the process's."""
        memory = self.memory
        if self.taken + size > memory.per_request:
            self._refusal("request")
            raise vectors_too_large(self.taken + size, memory.per_request)
        if memory.held + size > memory.total:
            self._refusal("budget")
            raise vectors_budget_exhausted(size, memory.total)
        memory.held += size
        memory.peak = max(memory.peak, memory.held)
        memory._changed()
        self.taken += size

    def give_back(self, size: int) -> None:
        size = min(size, self.taken)
        self.memory.held -= size
        self.memory._changed()
        self.taken -= size

    def refuse(self, size: int, param: str | None) -> ProxyError:
        """The 413 for a request whose matrices, known before sending, take ``size`` bytes."""
        self._refusal("request")
        return vectors_too_large(size, self.memory.per_request, param)

    def cut_off(self) -> None:
        """Cut the client's connection (too slow to take its response), where the server can."""
        self.memory.metrics.send_cuts += 1
        if self.cut is not None:
            self.cut()

    def close(self) -> None:
        self.give_back(self.taken)


_CURRENT: contextvars.ContextVar[VectorShare | None] = contextvars.ContextVar(
    "hidden_state_proxy_vector_share", default=None
)


@contextmanager
def sharing(
    memory: VectorMemory, scope: Scope | None = None, send_timeout: float | None = None
) -> Iterator[VectorShare]:
    """The current request's share for the duration of the block, given back at its end; with
    the server's way to cut the connection of ``scope`` (:data:`CUT_EXTENSION`), if any."""
    extensions = (scope or {}).get("extensions") or {}
    share = memory.share(send_timeout, extensions.get(CUT_EXTENSION))
    token = _CURRENT.set(share)
    try:
        yield share
    finally:
        _CURRENT.reset(token)
        share.close()


def take(size: int) -> None:
    """Charge ``size`` bytes to the current request's share (nothing outside a request)."""
    share = _CURRENT.get()
    if share is not None:
        share.take(size)


def give_back(size: int) -> None:
    share = _CURRENT.get()
    if share is not None:
        share.give_back(size)


def current() -> VectorShare | None:
    """The current request's share (``None`` outside a request)."""
    return _CURRENT.get()
