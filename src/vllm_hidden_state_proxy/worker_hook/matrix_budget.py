"""What the matrices being gathered in one vLLM worker may take (poolings ``"all_prompt"`` and
``"all_answer"``), decided before any row of them is kept.

A matrix's bytes are known when its request is first seen: ``P`` prompt positions for
``"all_prompt"``, at most ``max_tokens`` positions for ``"all_answer"``, times the layers and
the hidden size, in float32. One request may take the ring's max record
(``HIDDEN_STATE_PROXY_MAX_RECORD_MIB``): past it, an error record with status 413 at once. The
requests gathering together may take the arena's size (``HIDDEN_STATE_PROXY_ARENA_MIB``),
which is also what their rows on the device and, once published, in the arena may take: past
it, 503 (the engine is busy with matrices; a retry may fit). A request gives its bytes back
when its matrix is handed to the copy, or when it ends without one.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV, MAX_RECORD_MIB_ENV


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a matrix cannot be gathered: the error record's text and status."""

    message: str
    status: int


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


class MatrixBudget:
    """The bytes reserved by the matrices in flight, by vLLM request id."""

    def __init__(self, arena_bytes: int, max_record_bytes: int) -> None:
        self.arena_bytes = arena_bytes
        self.max_record_bytes = min(max_record_bytes, arena_bytes)
        self._reserved: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._reserved)

    @property
    def reserved(self) -> int:
        return self._total

    def reserve(self, req_id: str, size: int, what: str) -> Refusal | None:
        """Reserve ``size`` bytes for ``req_id``'s matrix (``what`` describes it: "a matrix of
        12 rows x 2 layers x 4096"); the refusal if it cannot be gathered. Again for a request
        that holds a reservation: nothing more is taken."""
        if req_id in self._reserved:
            return None
        if self.arena_bytes == 0:
            return Refusal(
                f"this vLLM server carries no matrices ({ARENA_MIB_ENV}=0 in its environment)",
                503,
            )
        if size > self.max_record_bytes:
            return Refusal(
                f"{what} takes {_mib(size)}, more than one request may: "
                f"{MAX_RECORD_MIB_ENV}={self.max_record_bytes >> 20} in vLLM's environment",
                413,
            )
        if self._total + size > self.arena_bytes:
            return Refusal(
                f"the matrices being gathered in this vLLM engine would take more than its "
                f"arena ({ARENA_MIB_ENV}={self.arena_bytes >> 20}): retry, or raise it",
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
