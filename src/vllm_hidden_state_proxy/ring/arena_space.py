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
- its region would overlap a region still reserved (``"busy"``: the matrices being gathered
  do not fit the arena together, counting headers and the tail left at a wrap; a retry, once
  some are published, may fit).

Thread-safe: regions are reserved on the worker's main thread and written on the thread that
forwards vLLM's output.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from vllm_hidden_state_proxy.ring.layout import arena_block_size


@dataclass(slots=True)
class _Region:
    offset: int
    end: int
    token: int
    published: bool = False


class ArenaFull(Exception):
    """A region cannot be reserved: ``reason`` is ``"large"`` or ``"busy"``."""

    def __init__(self, reason: str, size: int) -> None:
        super().__init__(f"a block of {size} bytes: {reason}")
        self.reason = reason
        self.size = size


class ArenaSpace:
    """The arena's regions, reserved and published, in the order they were reserved."""

    def __init__(self, arena_size: int, max_record: int) -> None:
        self.arena_size = arena_size
        self.max_record = min(max_record, arena_size)
        self._head = 0
        #: Regions reserved (not yet published) and blocks published (not yet written over),
        #: oldest first.
        self._regions: list[_Region] = []
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def fits(self, length: int) -> bool:
        """Whether a ``length``-byte payload's block is within the max record."""
        return arena_block_size(length) <= self.max_record

    @property
    def reserved(self) -> int:
        """Bytes of the regions reserved and not yet published."""
        with self._lock:
            return sum(r.end - r.offset for r in self._regions if not r.published)

    def reserve(self, length: int) -> int:
        """Reserve the region of a ``length``-byte payload's block; its token (for
        :meth:`publish` or :meth:`release`). Raises :class:`ArenaFull`."""
        size = arena_block_size(length)
        if size > self.max_record:
            raise ArenaFull("large", size)
        with self._lock:
            start = self._head if self._head + size <= self.arena_size else 0
            end = start + size
            for region in self._regions:
                if not region.published and region.offset < end and start < region.end:
                    raise ArenaFull("busy", size)
            token = next(self._tokens)
            self._regions.append(_Region(start, end, token))
            self._head = end
            return token

    def release(self, token: int) -> None:
        """Give back a region that will not be published (its request ended, its copy
        failed). Unknown or published tokens: nothing."""
        with self._lock:
            self._regions = [r for r in self._regions if r.published or r.token != token]

    def publish(self, token: int, length: int) -> tuple[int, list[int]]:
        """The region's offset, now the published block of a ``length``-byte payload, and the
        offsets of the published blocks it writes over (oldest first; they are forgotten).
        ``ValueError`` for a token not reserved, or a block larger than its region."""
        with self._lock:
            region = next((r for r in self._regions if r.token == token and not r.published), None)
            if region is None:
                raise ValueError(f"no region {token} is reserved in the arena")
            size = arena_block_size(length)
            if size > region.end - region.offset:
                raise ValueError(
                    f"a block of {size} bytes is larger than its region of "
                    f"{region.end - region.offset}"
                )
            covered = [
                r
                for r in self._regions
                if r.published and r.offset < region.end and region.offset < r.end
            ]
            gone = {id(r) for r in covered}
            self._regions = [r for r in self._regions if id(r) not in gone]
            region.published = True
            return region.offset, [r.offset for r in covered]
