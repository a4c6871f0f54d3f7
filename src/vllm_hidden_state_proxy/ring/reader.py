"""The proxy's side of one ring file: open and validate it, find a record by its request key.

**Finding a record.** The reader keeps its own map from request key to slot. Each lookup reads
the header's publish counter; if it moved, the reader reads only the index entries of the slots
published since (or the whole index, after more than N), so a lookup costs a dictionary probe
plus the new entries, whatever the slot count, and the proxy's cost per lookup stays flat as
rings are added. For a slot found that way it reads the seq (must be even), checks the slot's
key, CRCs the payload and decodes it straight out of the mapping, re-reads the seq (must be
unchanged), then requires the payload's own key to be the requested one and its shape to match
the header. Anything else is a miss (``None``), never another request's record. A matrix
record's rows are then copied out of its arena block, whose seq, key, length and CRC must be
the slot record's, and whose seq must be unchanged after the copy; otherwise newer blocks
have been written over it, and the lookup answers an error record (503) saying so.

**Large matrices off the lock.** :meth:`RingReader.find` leaves a matrix whose rows are at
least :data:`DEFER_BYTES` uncopied: it answers a :class:`PendingRows` (the slot's record, its
block, and a view of the block that keeps the mapping alive even if the reader is closed), and
:meth:`PendingRows.load`, run by the caller wherever it likes (the proxy: in a thread, after
counting its size against its memory budget), makes the same checks and copy as a lookup: seq,
key, length and CRC, the seq unchanged after the copy. It reads nothing of the reader, so the
directory's lock is not held while tens of MiB are copied and checked.

**Memory ordering.** The writer stores, in program order: index entry := zero, seq odd, slot
key/length/CRC/payload, seq even, index entry := key, publish counter += 1 (:mod:`.writer`),
with no fences (Python has none; each store is a ``memcpy``). On x86-64 (TSO) other cores see
stores in program order and loads are not reordered with older loads, so a reader that sees
the new counter also sees the index entry stored before it. On weakly ordered CPUs (ARM,
including GH200's Grace, POWER) neither holds: the reader may see the new counter and still
the old index entry (zero, or the slot's previous key), or a slot half old and half new.

- *Never a wrong record*, on any CPU: a stale or torn slot fails the seq, slot-key, CRC or
  payload-key check (the payload carries its own key, covered by the CRC), so a lookup answers
  the requested key's record or ``None``, whatever order the stores became visible in (short
  of a CRC-32 collision on a torn payload that also echoes the requested key).
- *No false miss*: a lookup takes each index entry once, when the counter moves, and would keep
  a stale one (the key missing from its map) until the slot is reused: a 504 for a record that
  is there. So the entries read within the last :data:`SETTLE` seconds are remembered, and
  :meth:`RingReader.recheck` reads them again; :class:`.directory.RingDirectory` calls it when
  a lookup found the key in no ring, and searches again if it changed anything. Entries are
  forgotten once re-read at least :data:`SETTLE` after their first read: a store is visible to
  other cores within microseconds (store buffers drain; the writer's lock release after each
  record is a barrier), far less than that. Only the miss path pays; a lookup that hits reads
  what it read before (the counter, its new entries, the slot).

**A shrinking file** under a live mapping would make reads fault (SIGBUS). Writers never
truncate, and only a ring's owner (a trusted user: vLLM's, or root) could. Before reading a
slot, and when the directory checks its files (every ~50 ms), the reader compares ``os.fstat``
of the open file against the mapped size and raises :class:`RingFormatError` if it shrank.
The publish counter, read on every lookup of every ring, is not guarded by that system call:
it would make a lookup's cost grow by a microsecond per ring.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import zlib
from collections import deque
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np

from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV
from vllm_hidden_state_proxy.ring.closing import ClosesOnExit
from vllm_hidden_state_proxy.ring.files import (
    Owners,
    Untrusted,
    open_trusted,
    writer_alive,
)
from vllm_hidden_state_proxy.ring.layout import (
    ARENA_KEY_OFFSET,
    ARENA_META,
    ARENA_PAYLOAD_OFFSET,
    ARENA_SEQ,
    FIXED_HEADER_SIZE,
    HDR_PUBLISH_COUNT_OFFSET,
    INDEX_ENTRY_SIZE,
    KEY_BYTES,
    PUBLISH_COUNT,
    SEQ,
    SLOT_KEY_OFFSET,
    SLOT_META,
    SLOT_PAYLOAD_OFFSET,
    ZERO_KEY,
    RingFormatError,
    RingHeader,
    RingShape,
    decode_payload,
    fixed_header_fields,
    parse_header,
)
from vllm_hidden_state_proxy.ring.records import (
    ArenaBlock,
    ErrorRecord,
    Found,
    Record,
)

logger = logging.getLogger("vllm_hidden_state_proxy.ring")


def written_over(arena_size: int) -> str:
    """The error of a matrix record whose rows newer records took the place of."""
    return (
        f"the rows were written over in the engine's arena ({arena_size >> 20} MiB) by newer "
        f"records before the proxy read them: raise {ARENA_MIB_ENV} in vLLM's environment, or "
        "retry"
    )


#: A matrix block at least this large is left for :meth:`PendingRows.load` by :meth:`find`.
DEFER_BYTES = 256 * 1024
#: Bytes copied per step by :meth:`PendingRows.load`.
COPY_STEP = 1 << 20


class PendingRows:
    """A matrix record found in a ring whose rows are not copied yet (see the module
    docstring, *Large matrices off the lock*)."""

    __slots__ = ("_view", "arena_size", "block", "record")

    def __init__(
        self, record: Record, block: ArenaBlock, view: memoryview, arena_size: int
    ) -> None:
        self.record = record
        self.block = block
        self.arena_size = arena_size
        #: The block, header and rows, as bytes of the mapping (an export: keeps it mapped).
        self._view = view

    @property
    def key(self) -> bytes:
        return self.record.key

    @property
    def size(self) -> int:
        """The rows' bytes, as the copy will take them."""
        return self.block.length

    def load(self) -> Found:
        """The record with its rows, or an error record (503) if newer blocks have been written
        over them. Thread-safe: reads only its own view."""
        view, block, record = self._view, self.block, self.record
        if ARENA_SEQ.unpack_from(view, 0)[0] == block.seq:
            key, n, crc = ARENA_META.unpack_from(view, ARENA_KEY_OFFSET)
            if key == record.key and n == block.length and crc == block.crc:
                # numpy copies without the GIL, into memory it does not zero first (a
                # bytearray's zeroing would hold the GIL for the whole size): the event loop
                # thread gets the GIL back within a step.
                rows = np.empty(n, dtype=np.uint8)
                source = np.frombuffer(view, dtype=np.uint8, count=n, offset=ARENA_PAYLOAD_OFFSET)
                for at in range(0, n, COPY_STEP):
                    np.copyto(rows[at : at + COPY_STEP], source[at : at + COPY_STEP])
                if ARENA_SEQ.unpack_from(view, 0)[0] == block.seq and zlib.crc32(rows.data) == crc:
                    return replace(record, vectors=rows.data)
        return ErrorRecord(record.key, written_over(self.arena_size), 503)


#: Seconds after its first read during which an index entry may still have been read stale on a
#: weakly ordered CPU (see *Memory ordering*): a miss reads such entries again.
SETTLE = 0.01


class RingReader(ClosesOnExit):
    """Read-only view of one ring file. Not thread-safe: the directory serialises its readers."""

    def __init__(
        self, *, path: Path, fd: int, mm: mmap.mmap, st: os.stat_result, header: RingHeader
    ) -> None:
        # Use RingReader.open().
        self.path = path
        self.header = header
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._identity = (st.st_dev, st.st_ino)
        self._size = len(mm)
        shape = header.shape
        self._shape = shape
        #: request key -> slot, and slot -> request key, for the slots read so far.
        self._slot_of: dict[bytes, int] = {}
        self._key_at: list[bytes | None] = [None] * shape.slot_count
        self._seen = 0
        #: (first, end, when): publish counts [first, end) whose index entries were first read
        #: at monotonic time ``when``, not yet re-read SETTLE later (see *Memory ordering*).
        self._unsettled: deque[tuple[int, int, float]] = deque()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, owner_uids: Owners = None) -> RingReader:
        """Open and validate a ring file; :class:`RingFormatError` (naming the file) otherwise.

        ``owner_uids``: the uid (or uids) the file must belong to; ``None`` accepts any.
        """
        p = Path(path)
        try:
            fd, st = open_trusted(p, owner_uids)
        except Untrusted as exc:
            raise RingFormatError(f"{p}: {exc}") from None
        try:
            header = _read_header(fd, st.st_size)
            mm = mmap.mmap(fd, header.shape.file_size, access=mmap.ACCESS_READ)
            if os.fstat(fd).st_size < header.shape.file_size:
                mm.close()
                raise RingFormatError("file shrank while opening")
        except RingFormatError as exc:
            os.close(fd)
            raise RingFormatError(f"{p}: {exc}") from None
        except (OSError, ValueError, OverflowError) as exc:
            os.close(fd)
            raise RingFormatError(f"{p}: cannot read/map: {exc}") from exc
        return cls(path=p, fd=fd, mm=mm, st=st, header=header)

    # -- fixed facts ---------------------------------------------------------------------------

    @property
    def shape(self) -> RingShape:
        return self._shape

    @property
    def hidden_size(self) -> int:
        return self._shape.hidden_size

    @property
    def slot_count(self) -> int:
        return self._shape.slot_count

    @property
    def layers(self) -> tuple[int, ...]:
        return self._shape.layers

    @property
    def epoch(self) -> int:
        return self.header.epoch

    @property
    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the mapped file."""
        return self._identity

    # -- live state ----------------------------------------------------------------------------

    def publish_count(self) -> int:
        """Records published into this ring so far (read from the header)."""
        mm = self._mm
        if mm is None:
            return 0
        self._check_size()
        value: int = PUBLISH_COUNT.unpack_from(mm, HDR_PUBLISH_COUNT_OFFSET)[0]
        return value

    def lookup(self, key: bytes) -> Found | None:
        """The record published under ``key``, or ``None``.

        Raises :class:`RingFormatError` only if the file shrank under the mapping.
        """
        found = self.find(key)
        return found.load() if isinstance(found, PendingRows) else found

    def find(self, key: bytes) -> Found | PendingRows | None:
        """As :meth:`lookup`, but a large matrix's rows are left for :meth:`PendingRows.load`."""
        mm = self._mm
        if mm is None or not isinstance(key, bytes) or len(key) != KEY_BYTES or key == ZERO_KEY:
            return None
        # The counter is read without the size check: it is the per-ring cost of every lookup
        # (see the module docstring for why that is safe enough); the slot read is checked.
        count = PUBLISH_COUNT.unpack_from(mm, HDR_PUBLISH_COUNT_OFFSET)[0]
        if count != self._seen:
            self._read_index(count)
        slot = self._slot_of.get(bytes(key))  # bytes(): a subclass could override __eq__
        if slot is None:
            return None
        self._check_size()
        return self._read_slot(slot, bytes(key))

    def _read_index(self, count: int) -> None:
        """Bring the key map up to ``count`` published records."""
        mm = self._mm
        if mm is None:
            return
        n = self._shape.slot_count
        # A new file's history, or a reader that fell behind, reads every slot. Either way
        # slots go in publish order, oldest first, so that a key published twice maps to its
        # newest slot (the one overwritten last).
        every_slot = count < self._seen or count - self._seen >= n
        first = count - n if every_slot else self._seen
        # What _take does, inlined: this runs on every lookup that sees new records.
        base = self._shape.index_offset
        key_at, slot_of = self._key_at, self._slot_of
        for c in range(first, count):
            slot = c % n
            at = base + slot * INDEX_ENTRY_SIZE
            key = mm[at : at + INDEX_ENTRY_SIZE]
            old = key_at[slot]
            if old is not None and slot_of.get(old) == slot:
                del slot_of[old]
            if key == ZERO_KEY:  # being rewritten: its new record comes with a later count
                key_at[slot] = None
            else:
                key_at[slot] = key
                slot_of[key] = slot
        self._seen = count
        unsettled = self._unsettled
        if every_slot:
            unsettled.clear()
        # Entries of counts before count - n have been published over since: their slots'
        # newer entries are in the later ranges.
        while unsettled and unsettled[0][1] <= count - n:
            unsettled.popleft()
        unsettled.append((first, count, time.monotonic()))

    def _take(self, mm: mmap.mmap, slot: int) -> bool:
        """Read ``slot``'s index entry into the key map; True if it changed."""
        at = self._shape.index_offset + slot * INDEX_ENTRY_SIZE
        key = mm[at : at + INDEX_ENTRY_SIZE]
        old = self._key_at[slot]
        if key == old:  # the same key again: it still maps here (publish order)
            if self._slot_of.get(key) == slot:
                return False
            self._slot_of[key] = slot
            return True
        if key == ZERO_KEY and old is None:
            return False
        if old is not None and self._slot_of.get(old) == slot:
            del self._slot_of[old]
        if key == ZERO_KEY:  # being rewritten: its new record comes with a later count
            self._key_at[slot] = None
        else:
            self._key_at[slot] = key
            self._slot_of[key] = slot
        return True

    def recheck(self) -> bool:
        """Read again the index entries first read within the last :data:`SETTLE` seconds (and
        those not re-read since), which a weakly ordered CPU may have shown stale; True if the
        key map changed. For the miss path: a lookup that found nothing anywhere."""
        mm = self._mm
        unsettled = self._unsettled
        if mm is None or not unsettled:
            return False
        n = self._shape.slot_count
        oldest = self._seen - n
        changed = False
        for first, end, _ in unsettled:  # in publish order: the newest key of a slot wins
            for c in range(max(first, oldest), end):
                changed |= self._take(mm, c % n)
        settled_before = time.monotonic() - SETTLE
        while unsettled and unsettled[0][2] <= settled_before:
            unsettled.popleft()  # re-read just now, at least SETTLE after its first read
        return changed

    def _read_slot(self, slot: int, key: bytes) -> Found | PendingRows | None:
        mm = self._mm
        mv = self._mv
        if mm is None or mv is None:
            return None
        shape = self._shape
        off = shape.slots_offset + slot * shape.slot_size
        seq = SEQ.unpack_from(mm, off)[0]
        if seq & 1:
            return None  # the writer is working on this slot
        slot_key, n, crc = SLOT_META.unpack_from(mm, off + SLOT_KEY_OFFSET)
        if slot_key != key or n > shape.payload_capacity:
            return None
        start = off + SLOT_PAYLOAD_OFFSET
        with mv[start : start + n] as payload:
            if zlib.crc32(payload) != crc:
                return None
            try:
                obj = msgpack.unpackb(payload, raw=False)
            except Exception:
                return None
        if SEQ.unpack_from(mm, off)[0] != seq:
            return None  # overwritten while we read it
        decoded = decode_payload(obj, key, shape)
        if isinstance(decoded, tuple):
            return self._read_block(*decoded)
        return decoded

    def _read_block(self, record: Record, block: ArenaBlock) -> Found | PendingRows | None:
        """``record`` with its rows, copied out of ``block``; an error record if newer blocks
        have been written over it."""
        mm = self._mm
        if mm is None:
            return None
        base = self._shape.arena_offset + block.offset
        if block.length >= DEFER_BYTES and block.length <= self._shape.arena_size:
            end = base + ARENA_PAYLOAD_OFFSET + block.length
            if end <= len(mm):
                view = np.frombuffer(mm, dtype=np.uint8, count=end - base, offset=base).data
                return PendingRows(record, block, view, self._shape.arena_size)
        if ARENA_SEQ.unpack_from(mm, base)[0] == block.seq:
            key, n, crc = ARENA_META.unpack_from(mm, base + ARENA_KEY_OFFSET)
            if key == record.key and n == block.length and crc == block.crc:
                start = base + ARENA_PAYLOAD_OFFSET
                rows = mm[start : start + n]
                if ARENA_SEQ.unpack_from(mm, base)[0] == block.seq and zlib.crc32(rows) == crc:
                    return replace(record, vectors=rows)
        return ErrorRecord(record.key, written_over(self._shape.arena_size), 503)

    def _check_size(self) -> None:
        fd = self._fd
        if fd is None:
            raise RingFormatError(f"{self.path}: reader is closed")
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise RingFormatError(f"{self.path}: fstat failed: {exc}") from exc
        if size < self._size:
            raise RingFormatError(
                f"{self.path}: truncated after mapping ({size} < {self._size} bytes)"
            )

    def is_live(self) -> bool:
        """True while a writer holds this file's liveness lock (its process is alive).

        False for a closed reader. A probe error (no locking on this file system) counts as
        live.
        """
        fd = self._fd
        if fd is None:
            return False
        return writer_alive(fd)

    def is_stale(self) -> bool:
        """True if ``self.path`` is gone, now names a different file than the one mapped, or
        the mapped file shrank."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity or st.st_size < self._size

    def close(self) -> None:
        mv, self._mv = self._mv, None
        mm, self._mm = self._mm, None
        fd, self._fd = self._fd, None
        self._slot_of.clear()
        self._unsettled.clear()
        if mv is not None:
            mv.release()
        if mm is not None:
            # BufferError: a slice is still referenced (e.g. by a traceback); GC unmaps it.
            with contextlib.suppress(BufferError):
                mm.close()
        if fd is not None:
            os.close(fd)


def _read_header(fd: int, file_size: int) -> RingHeader:
    """Read and validate the header with ``pread`` (nothing is mapped before it is valid)."""
    fixed = os.pread(fd, FIXED_HEADER_SIZE, 0)
    if len(fixed) < FIXED_HEADER_SIZE:
        return parse_header(fixed, file_size)  # raises: truncated
    header_size, _ = fixed_header_fields(fixed)
    if header_size > len(fixed):
        fixed = os.pread(fd, min(header_size, file_size, 1 << 16), 0)
    return parse_header(fixed, file_size)
