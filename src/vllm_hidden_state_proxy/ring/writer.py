"""The worker hook's side: create one engine's ring and publish records into it.

Publishing one record (slot = counter % N): zero the slot's index entry -> seq := seq+1 (odd)
-> key, length, crc, payload -> seq := seq+2 (even) -> index entry := key -> header publish
counter += 1. The seq and publish counter are stored with the host's native 8-byte ``memcpy``
(``struct`` native mode, little-endian hosts) so they are single aligned stores. The writer
never waits for readers: slots are reused in FIFO order.

**A matrix record** (pooling ``all_prompt``/``all_answer``) first writes its rows as a block
in the arena, in the region reserved for it (:mod:`.arena_space`: when its request was first
seen, or now): every older block the region covers gets an odd seq first (written over), then
seq odd -> key, length, crc, payload -> seq even; then the slot record pointing at it goes out
as above. So the arena, like the slots, is reused oldest first, and a reader tells a block
written over from its own record (see :mod:`.layout`). The payload is any buffer (a
contiguous numpy array's memoryview): its crc is taken over it once, and it is copied into the
mapping once.

The writer never truncates its file (a mapping of a shrunk file faults with SIGBUS): a restarted
writer makes a new file, named for its instance and engine, and old files of dead writers are
swept (see :mod:`.files`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

from vllm_hidden_state_proxy.protocol import MATRIX_POOLINGS, POOLINGS, RING_DIR_ENV
from vllm_hidden_state_proxy.ring.arena_space import ArenaFull, ArenaSpace
from vllm_hidden_state_proxy.ring.closing import ClosesOnExit
from vllm_hidden_state_proxy.ring.files import (
    PRIVATE_MODES,
    InUse,
    create_directory,
    forget_in_forked_children,
    install,
    new_locked_temp,
    ring_name,
    sweep_dead,
)
from vllm_hidden_state_proxy.ring.layout import (
    ARENA_KEY_OFFSET,
    ARENA_META,
    ARENA_PAYLOAD_OFFSET,
    ARENA_SEQ,
    HDR_PUBLISH_COUNT_OFFSET,
    HDR_VERSION_OFFSET,
    INDEX_ENTRY_SIZE,
    KEY_BYTES,
    LAYOUT_VERSION,
    MAX_ARENA_SIZE,
    MAX_SLOT_COUNT,
    MAX_SLOT_SIZE,
    PUBLISH_COUNT,
    SEQ,
    SLOT_KEY_OFFSET,
    SLOT_META,
    SLOT_PAYLOAD_OFFSET,
    VERSION,
    ZERO_KEY,
    RingHeader,
    RingShape,
    check_layers,
    pack_header,
    slot_size_for,
)
from vllm_hidden_state_proxy.ring.records import (
    HOOK_FAILED_STATUS,
    ArenaBlock,
    Record,
    matrix_bytes,
    pack_error,
    pack_record,
)

logger = logging.getLogger("vllm_hidden_state_proxy.ring")


class RingInUseError(Exception):
    """Another live writer holds the ring file this writer was to create."""


class RingWriter(ClosesOnExit):
    """Single-process writer of one ring file. ``publish`` never blocks on readers.

    Holds an exclusive ``flock`` on the file from :meth:`create` until :meth:`close` (or until
    the process exits): that lock is what readers see as "the writer is alive".
    """

    def __init__(
        self, *, path: Path, fd: int, mm: mmap.mmap, header: RingHeader, model: str
    ) -> None:
        # Use RingWriter.create(); this only wires up an already initialised mapping.
        self.path = path
        self.header = header
        self.model = model
        self._fd: int | None = fd  # holds the liveness lock
        self._mm: mmap.mmap | None = mm
        self._count = 0
        self._lock = threading.Lock()
        #: The arena's regions (reserved, and published blocks not yet written over), and the
        #: count of blocks written.
        self.space = ArenaSpace(header.shape.arena_size, header.shape.max_record)
        self._block_count = 0
        forget_in_forked_children(self)

    # -- fixed facts ---------------------------------------------------------------------------

    @property
    def shape(self) -> RingShape:
        return self.header.shape

    @property
    def hidden_size(self) -> int:
        return self.header.shape.hidden_size

    @property
    def slot_count(self) -> int:
        return self.header.shape.slot_count

    @property
    def layers(self) -> tuple[int, ...]:
        return self.header.shape.layers

    @property
    def epoch(self) -> int:
        return self.header.epoch

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        hidden_size: int,
        model: str,
        slot_count: int,
        instance: int = 0,
        engine: int = 0,
        num_hidden_layers: int = 1,
        layers: Sequence[int] | None = None,
        dir_mode: int = PRIVATE_MODES[0],
        file_mode: int = PRIVATE_MODES[1],
        runner: str = "",
        arena_size: int = 0,
        max_record: int | None = None,
    ) -> RingWriter:
        """Make ``<directory>/ring-<instance>-dp<engine>.bin`` and hold its liveness lock.

        ``layers`` (absolute indices, default: the final layer ``num_hidden_layers`` only) are
        what records of this ring may hold; ``runner`` says which vLLM and model runner the
        hook wraps (the header keeps 48 ASCII characters of it). ``arena_size`` bytes (rounded
        down to a multiple of 64) carry matrix records of at most ``max_record`` bytes each
        (default: the arena's size). Sweeps files of writers that
        are gone; raises :class:`RingInUseError` (and leaves everything as it was) if a live
        writer holds the name.
        """
        if not isinstance(model, str):
            raise TypeError("model must be a str")
        model.encode("utf-8")  # surrogates would fail later, in publish; fail here instead
        if isinstance(slot_count, bool) or not isinstance(slot_count, int):
            raise TypeError("slot_count must be an int")
        if not 1 <= slot_count <= MAX_SLOT_COUNT:
            raise ValueError(f"slot_count must be in [1, {MAX_SLOT_COUNT}], got {slot_count}")
        if not 0 <= instance < 1 << 64 or not 0 <= engine < 1 << 31:
            raise ValueError(f"instance {instance} or engine {engine} out of range")
        if file_mode & 0o022:
            raise ValueError(
                f"file_mode {file_mode:#o} is group/other-writable; readers refuse such files"
            )
        captured = (num_hidden_layers,) if layers is None else tuple(sorted(set(layers)))
        check_layers(captured, num_hidden_layers)
        slot_size = slot_size_for(hidden_size, len(captured), model)
        if slot_size > MAX_SLOT_SIZE:
            raise ValueError(f"slot size {slot_size} exceeds {MAX_SLOT_SIZE} (model name?)")
        arena = arena_size // 64 * 64
        record_limit = arena if max_record is None else max_record
        if not 0 <= record_limit <= arena <= MAX_ARENA_SIZE:
            raise ValueError(
                f"an arena of {arena_size} bytes for records of {record_limit} is out of range "
                f"(a max record no larger than the arena, at most {MAX_ARENA_SIZE})"
            )
        shape = RingShape(
            slot_count, slot_size, hidden_size, num_hidden_layers, captured, arena, record_limit
        )
        header = RingHeader(
            shape=shape,
            epoch=secrets.randbits(64) or 1,
            writer_pid=os.getpid(),
            engine=engine,
            instance=instance,
            runner=runner,
        )
        d = Path(directory)
        create_directory(d, dir_mode)
        final = d / ring_name(instance, engine)
        sweep_dead(d)
        fd, tmp_name = new_locked_temp(d, final.stem, file_mode)
        mm: mmap.mmap | None = None
        try:
            _reserve(fd, shape.file_size, d)
            mm = mmap.mmap(fd, shape.file_size)
            raw = pack_header(header)
            mm[: len(raw)] = raw
            VERSION.pack_into(mm, HDR_VERSION_OFFSET, LAYOUT_VERSION)  # ready flag, last
            try:
                install(tmp_name, final)
            except InUse as exc:
                raise RingInUseError(
                    f"{exc}: another vLLM engine with the same instance and engine index is "
                    f"publishing there. Give each vLLM its own ring directory ({RING_DIR_ENV})."
                ) from None
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)  # releases the lock
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        logger.info(
            "created ring file %s (epoch %016x, %d slots x %d bytes, hidden_size %d, layers %s)",
            final,
            header.epoch,
            slot_count,
            slot_size,
            hidden_size,
            ",".join(map(str, captured)),
        )
        return cls(path=final, fd=fd, mm=mm, header=header, model=model)

    def forget_after_fork(self) -> None:
        """In a forked child: drop our copies of the descriptors (without unlocking)."""
        mm, self._mm = self._mm, None
        fd, self._fd = self._fd, None
        with contextlib.suppress(Exception):
            if mm is not None:
                mm.close()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- publishing ----------------------------------------------------------------------------

    def publish_count(self) -> int:
        """Records published so far by this writer."""
        return self._count

    def publish(
        self,
        key: bytes,
        vectors: bytes | memoryview,
        *,
        position: int,
        num_prompt_tokens: int,
        layers: Sequence[int] | None = None,
        pooling: str = "last",
        rows: int = 1,
        region: int | None = None,
    ) -> None:
        """Publish ``vectors`` (LE float32, ``rows`` x ``hidden_size`` values per layer of
        ``layers``, default: the final layer; any buffer, read once) under ``key``; a matrix
        pooling's through the arena: into ``region`` (a token of ``self.space.reserve``), or a
        region reserved now (``ValueError`` if its block is larger than the ring's max record,
        or overlaps a region still reserved)."""
        _check_key(key)
        taken = (self.shape.num_hidden_layers,) if layers is None else tuple(layers)
        if not taken or len(set(taken)) != len(taken) or not set(taken) <= set(self.layers):
            raise ValueError(f"layers {taken} are not distinct captured layers {self.layers}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
        matrix = pooling in MATRIX_POOLINGS
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or (rows > 1 > matrix):
            raise ValueError(f"rows must be 1, or at least 1 for a matrix pooling: {rows!r}")
        expected = matrix_bytes(rows, len(taken), self.hidden_size)
        payload = memoryview(vectors).cast("B")
        if payload.nbytes != expected:
            raise ValueError(
                f"vectors must be {expected} bytes (float32 x {self.hidden_size} x {rows} rows "
                f"x {len(taken)} layers), got {payload.nbytes}"
            )
        for name, value in (("position", position), ("num_prompt_tokens", num_prompt_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int")
            if not 0 <= value < (1 << 64):
                raise ValueError(f"{name} out of range")
        record = Record(
            key=key,
            model=self.model,
            position=position,
            num_prompt_tokens=num_prompt_tokens,
            pooling=pooling,
            layers=taken,
            hidden_size=self.hidden_size,
            vectors=b"" if matrix else payload.tobytes(),
            rows=rows,
        )
        if not matrix:
            self._write(key, pack_record(record))
            return
        if region is None:
            try:
                region = self.space.reserve(expected)
            except ArenaFull as full:
                raise ValueError(
                    f"a matrix record's block of {full.size} bytes exceeds this ring's max "
                    f"record of {self.shape.max_record}"
                    if full.reason == "large"
                    else f"a matrix record's block of {full.size} bytes overlaps a region "
                    "reserved for another matrix"
                ) from None
        try:
            with self._lock:  # block and slot in one go: two writers could not interleave them
                block = self._write_block(key, payload, region)
                self._write_slot(key, pack_record(record, block))
        except BaseException:
            self.space.release(region)
            raise

    def publish_error(self, key: bytes, message: str, status: int = HOOK_FAILED_STATUS) -> None:
        """Publish an error record: the proxy answers this request key with ``message`` (and
        ``status``) at once instead of waiting for vectors that will not come."""
        _check_key(key)
        self._write(key, pack_error(key, message, status))

    def _write_block(self, key: bytes, payload: memoryview, region: int) -> ArenaBlock:
        """Write ``payload`` as the arena's newest block, in ``region`` (the lock is held)."""
        mm = self._mm
        if mm is None:
            raise ValueError("ring writer is closed")
        base = self.shape.arena_offset
        head, covered = self.space.publish(region, payload.nbytes)
        for offset in covered:  # each gets an odd seq before anything is written
            seq = ARENA_SEQ.unpack_from(mm, base + offset)[0]
            ARENA_SEQ.pack_into(mm, base + offset, seq | 1)
        n = payload.nbytes
        self._block_count += 1
        seq = (2 * self._block_count) & 0xFFFFFFFFFFFFFFFE
        at = base + head
        ARENA_SEQ.pack_into(mm, at, seq | 1)
        crc = zlib.crc32(payload)
        ARENA_META.pack_into(mm, at + ARENA_KEY_OFFSET, key, n, crc)
        start = at + ARENA_PAYLOAD_OFFSET
        mm[start : start + n] = payload
        ARENA_SEQ.pack_into(mm, at, seq)
        return ArenaBlock(head, n, crc, seq)

    def _write(self, key: bytes, payload: bytes) -> None:
        with self._lock:
            self._write_slot(key, payload)

    def _write_slot(self, key: bytes, payload: bytes) -> None:
        """Write ``payload`` into the next slot (the lock is held)."""
        n = len(payload)
        capacity = self.shape.payload_capacity
        if n > capacity:  # cannot happen given slot_size_for; keep the file sane
            raise ValueError(f"payload of {n} bytes exceeds the slot capacity {capacity}")
        crc = zlib.crc32(payload)
        shape = self.shape
        mm = self._mm
        if mm is None:
            raise ValueError("ring writer is closed")
        count = self._count
        slot = count % shape.slot_count
        idx = shape.index_offset + slot * INDEX_ENTRY_SIZE
        off = shape.slots_offset + slot * shape.slot_size
        mm[idx : idx + KEY_BYTES] = ZERO_KEY
        seq = SEQ.unpack_from(mm, off)[0] | 1  # odd: writer at work
        SEQ.pack_into(mm, off, seq)
        SLOT_META.pack_into(mm, off + SLOT_KEY_OFFSET, key, n, crc)
        start = off + SLOT_PAYLOAD_OFFSET
        mm[start : start + n] = payload
        SEQ.pack_into(mm, off, (seq + 1) & 0xFFFFFFFFFFFFFFFF)  # even: done
        mm[idx : idx + KEY_BYTES] = key
        self._count = count + 1
        PUBLISH_COUNT.pack_into(mm, HDR_PUBLISH_COUNT_OFFSET, self._count)

    def close(self) -> None:
        """Unmap and release the liveness lock. The file stays: readers may still be reading it.

        Readers then see the ring as not live, and a new writer may take its name.
        """
        with self._lock:
            mm, self._mm = self._mm, None
            fd, self._fd = self._fd, None
        try:
            if mm is not None:
                mm.close()
        finally:
            if fd is not None:
                # Explicit: the mapping's own descriptor shares the lock until it is closed.
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes")
    if key == ZERO_KEY:
        raise ValueError("the all-zero key marks empty index entries and cannot be used")


def _reserve(fd: int, size: int, directory: Path) -> None:
    """Size the file, reserving the pages so that a full tmpfs fails here, not as SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, size)
        else:
            raise OSError(
                exc.errno,
                f"cannot reserve {size} bytes for a ring file in {directory}: {exc.strerror}",
            ) from exc
