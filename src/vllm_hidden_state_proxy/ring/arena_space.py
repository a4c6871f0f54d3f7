"""Where the arena's blocks go: a region is reserved for a matrix when its request is first
seen, and its block is written there when the matrix is published.

The arena is used round and round (oldest first, like the slots), one region after the
other from the write head; a region that does not fit before the arena's end starts over at
its beginning (the tail is left unused until the head comes round again). A region counts
the whole block: its 64-byte header and its payload, padded to 64 (``arena_block_size``).

What a reservation promises: its region overlaps no other region reserved and not yet
published, so its block is written whole and no matrix reserved before it was published
writes over it. Once published, the block stays until a region reserved after that is
written over it (the writer cannot know when the proxy has read a block: readers never write
to the ring). A reservation is refused when

- its block is larger than the ring's max record (``"large"``: one request may not take it),
- no place for its region is free of regions still reserved (``"busy"``: the matrices being
  gathered do not fit the arena together, counting headers and the tail left at a wrap; a
  retry, once some are published, may fit). The region goes at the write head, or just past
  the reserved regions it would overlap (a long answer still being gathered does not hold up
  the matrices after it), back at the arena's start once when its end is reached.

Thread-safe: regions are reserved on the worker's main thread and written on the thread that
forwards vLLM's output.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass

from vllm_hidden_state_proxy.ring.layout import arena_block_size


@dataclass(frozen=True, slots=True)
class _Region:
    offset: int
    end: int


class ArenaFull(Exception):
    """A region cannot be reserved: ``reason`` is ``"large"`` or ``"busy"``."""

    def __init__(self, reason: str, size: int) -> None:
        super().__init__(f"a block of {size} bytes: {reason}")
        self.reason = reason
        self.size = size


class ArenaSpace:
    """The arena's regions reserved (by token) and its published blocks (by offset)."""

    def __init__(self, arena_size: int, max_record: int) -> None:
        self.arena_size = arena_size
        self.max_record = min(max_record, arena_size)
        self._head = 0
        #: Regions reserved and not yet published: few (the matrices in flight).
        self._pending: dict[int, _Region] = {}
        #: Published blocks not yet written over: they never overlap, so kept sorted by
        #: offset (a new block finds the ones it covers by bisection).
        self._offsets: list[int] = []
        self._ends: dict[int, int] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def fits(self, length: int) -> bool:
        """Whether a ``length``-byte payload's block is within the max record."""
        return arena_block_size(length) <= self.max_record

    @property
    def reserved(self) -> int:
        """Bytes of the regions reserved and not yet published."""
        with self._lock:
            return sum(r.end - r.offset for r in self._pending.values())

    def reserve(self, length: int) -> int:
        """Reserve the region of a ``length``-byte payload's block; its token (for
        :meth:`publish` or :meth:`release`). Raises :class:`ArenaFull`."""
        size = arena_block_size(length)
        if size > self.max_record:
            raise ArenaFull("large", size)
        with self._lock:
            start = self._place(size)
            token = next(self._tokens)
            self._pending[token] = _Region(start, start + size)
            self._head = start + size
            return token

    def _place(self, size: int) -> int:
        """Where a region of ``size`` bytes goes: at the head, or past the regions still
        reserved that it would overlap (a long answer being gathered does not hold up the
        others), back at the start once when the arena's end is reached. ``ArenaFull``
        ("busy") when no place is free of reserved regions."""
        start = self._head if self._head + size <= self.arena_size else 0
        wrapped = start == 0
        for _ in range(2 * len(self._pending) + 2):
            blocking = [
                r.end for r in self._pending.values() if r.offset < start + size and start < r.end
            ]
            if not blocking:
                return start
            start = max(blocking)
            if start + size > self.arena_size:
                if wrapped:
                    break
                start, wrapped = 0, True
        raise ArenaFull("busy", size)

    def release(self, token: int) -> None:
        """Give back a region that will not be published (its request ended, its copy
        failed). Unknown or published tokens: nothing."""
        with self._lock:
            self._pending.pop(token, None)

    def publish(self, token: int, length: int) -> tuple[int, list[int]]:
        """The region's offset, now the published block of a ``length``-byte payload, and the
        offsets of the published blocks it writes over (they are forgotten). ``ValueError``
        for a token not reserved, or a block larger than its region (which goes back)."""
        with self._lock:
            region = self._pending.pop(token, None)
            if region is None:
                raise ValueError(f"no region {token} is reserved in the arena")
            size = arena_block_size(length)
            if size > region.end - region.offset:
                raise ValueError(
                    f"a block of {size} bytes is larger than its region of "
                    f"{region.end - region.offset}"
                )
            offsets = self._offsets
            first = bisect.bisect_left(offsets, region.offset)
            if first and self._ends[offsets[first - 1]] > region.offset:
                first -= 1
            last = bisect.bisect_left(offsets, region.end, first)
            covered = offsets[first:last]
            del offsets[first:last]
            for offset in covered:
                del self._ends[offset]
            offsets.insert(first, region.offset)
            self._ends[region.offset] = region.end
            return region.offset, covered
