"""What the requests being gathered in one vLLM worker may take, decided before any row of
them is kept: their matrices' regions of the arena (:class:`MatrixBudget`), and what they keep
on the device across steps (:class:`DeviceBudget`).

**The arena.** A matrix's bytes are known when its request is first seen: ``P`` prompt
positions for ``"all_prompt"``, the spans for ``"spans"``, at most ``max_tokens`` positions for
``"all_answer"``, times the layers and the hidden size, in float32. Its block (those bytes, a
64-byte header, padded to 64) is reserved then as a region of the arena
(:mod:`vllm_hidden_state_proxy.ring.arena_space`): a block larger than the ring's max record
(``HIDDEN_STATE_PROXY_MAX_RECORD_MIB``) is an error record with status 413 at once; a region
that would overlap one still reserved (the matrices being gathered do not fit the arena
together, headers and the tail left at a wrap counted) is a 503 (a retry may fit). The region
goes with the matrix to the copy (:meth:`MatrixBudget.hand_over`) and is written when it is
published; a request that ends without one gives it back.

**The device.** Between steps the hook keeps, per request: an ``"all_prompt"`` matrix's rows
so far, a ``"spans"`` request's sums (and, within a step, one layer's running sum of the
step's rows), an answer's kept rows (every position of ``"all_answer"``, the latest
:data:`~vllm_hidden_state_proxy.protocol.ANSWER_WINDOW` of ``"last_answer"``). Each is counted
at its most, in float32 (the widest dtype vLLM runs a model in), when the request is first
seen, against ``HIDDEN_STATE_PROXY_DEVICE_MIB``: one request over it alone is a 413, the
requests in flight together over it a 503. ``"mean"`` and ``"last"`` keep one
``[layers, hidden]`` vector a request at most and are not counted.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV, DEVICE_MIB_ENV, MAX_RECORD_MIB_ENV
from vllm_hidden_state_proxy.ring.arena_space import ArenaFull
from vllm_hidden_state_proxy.ring.layout import arena_block_size


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request's state cannot be gathered: the error record's text and status."""

    message: str
    status: int


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


class MatrixBudget:
    """The arena regions reserved by the matrices in flight, by vLLM request id.

    ``space`` is the ring writer's :class:`~vllm_hidden_state_proxy.ring.arena_space.ArenaSpace`
    (``None`` or an arena of 0 bytes: no matrices)."""

    def __init__(self, space: Any | None) -> None:
        self.space = space
        self.arena_bytes = 0 if space is None else int(space.arena_size)
        self.max_record_bytes = 0 if space is None else int(space.max_record)
        self._reserved: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._reserved)

    def reserve(self, req_id: str, size: int, what: str) -> Refusal | None:
        """Reserve the region of ``req_id``'s matrix of ``size`` bytes (``what`` describes it:
        "a matrix of 12 rows x 2 layers x 4096"); the refusal if it cannot be gathered. Again
        for a request that holds a reservation: nothing more is taken."""
        if req_id in self._reserved:
            return None
        if self.space is None or self.arena_bytes == 0:
            return Refusal(
                f"this vLLM server carries no matrices ({ARENA_MIB_ENV}=0 in its environment)",
                503,
            )
        try:
            self._reserved[req_id] = self.space.reserve(size)
        except ArenaFull as full:
            if full.reason == "large":
                return Refusal(
                    f"{what} takes {_mib(arena_block_size(size))} in the arena with its "
                    f"block's header, more than one request may: {MAX_RECORD_MIB_ENV}="
                    f"{self.max_record_bytes >> 20} in vLLM's environment",
                    413,
                )
            return Refusal(
                f"the matrices being gathered in this vLLM engine would take more than its "
                f"arena ({ARENA_MIB_ENV}={self.arena_bytes >> 20}): retry, or raise it",
                503,
            )
        return None

    def hand_over(self, req_id: str) -> int | None:
        """``req_id``'s region, which its matrix's copy now holds (the ring writer writes it,
        or the publication gives it back); ``None`` if it holds none."""
        return self._reserved.pop(req_id, None)

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            token = self._reserved.pop(req_id, None)
            if token is not None and self.space is not None:
                self.space.release(token)

    def keep_only(self, live: Container[str]) -> None:
        """Give back the regions of requests no longer in flight (finished, aborted)."""
        self.release([req_id for req_id in self._reserved if req_id not in live])


class DeviceBudget:
    """The device bytes the requests in flight may keep across steps, by vLLM request id."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._reserved: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._reserved)

    @property
    def reserved(self) -> int:
        return self._total

    def reserve(self, req_id: str, size: int, what: str) -> Refusal | None:
        """Count ``size`` bytes for ``req_id`` (``what`` describes them: "the spans' sums of
        ..."); the refusal if they are more than may be kept. Again for a request that holds a
        reservation: nothing more is taken."""
        if req_id in self._reserved:
            return None
        if size > self.limit:
            return Refusal(
                f"{what} would keep {_mib(size)} on the device, more than this vLLM worker "
                f"keeps for all requests: {DEVICE_MIB_ENV}={self.limit >> 20} in vLLM's "
                "environment",
                413,
            )
        if self._total + size > self.limit:
            return Refusal(
                f"the requests gathering hidden states in this vLLM engine would keep more than "
                f"{DEVICE_MIB_ENV}={self.limit >> 20} MiB on the device: retry, or raise it",
                503,
            )
        self._reserved[req_id] = size
        self._total += size
        return None

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._total -= self._reserved.pop(req_id, 0)

    def keep_only(self, live: Container[str]) -> None:
        """Give back the bytes of requests no longer in flight (finished, aborted)."""
        self.release([req_id for req_id in self._reserved if req_id not in live])
