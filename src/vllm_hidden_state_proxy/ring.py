"""Shared-memory ring of hidden-state records: one file per writer, many readers.

The vLLM worker hook (:class:`RingWriter`) publishes the last hidden state of each flagged
request into a fixed-size slot of a memory-mapped file; the proxy (:class:`RingReader`, or
:class:`RingDirectory` for every ring in a directory) finds the record by its 16-byte key.
The writer never waits for readers: slots are reused in FIFO order and a per-slot seqlock,
a CRC and two key checks let a reader prove that what it copied is the requested record.

File ``<directory>/ring-<writer_id>.bin``, little-endian throughout (N = slot count,
Z = slot size)::

    offset                                                   constants (offset / struct format)
         0 +-----------------------------------------------+
           | magic  b"VHSRING\\0"                  8 bytes | HDR_MAGIC_OFFSET / HDR_MAGIC_FMT
         8 | layout version u32  (*)                       | HDR_VERSION_OFFSET / ..._FMT
        12 | header size u32 (= 64)                        | HDR_HEADER_SIZE_OFFSET / ..._FMT
        16 | slot size u32 (Z, multiple of 64)             | HDR_SLOT_SIZE_OFFSET / ..._FMT
        20 | slot count u32 (N)                            | HDR_SLOT_COUNT_OFFSET / ..._FMT
        24 | key size u32 (= 16)                           | HDR_KEY_SIZE_OFFSET / ..._FMT
        28 | hidden size u32                               | HDR_HIDDEN_SIZE_OFFSET / ..._FMT
        32 | writer epoch u64 (random, new per file)       | HDR_EPOCH_OFFSET / ..._FMT
        40 | writer pid u32                                | HDR_WRITER_PID_OFFSET / ..._FMT
        44 | reserved u32 (0)                              | HDR_RESERVED0_OFFSET / ..._FMT
        48 | publish counter u64 (records published)       | HDR_PUBLISH_COUNT_OFFSET / ..._FMT
        56 | reserved u64 (0)                              | HDR_RESERVED1_OFFSET / ..._FMT
        64 +-----------------------------------------------+ INDEX_OFFSET (= HEADER_SIZE)
           | key of slot 0                        16 bytes | INDEX_ENTRY_SIZE (= KEY_BYTES)
           | key of slot 1          (all zeros when empty) |
           | ...                                           |
           | key of slot N-1                               |
           +-----------------------------------------------+
           | zero padding up to a multiple of 64           |
         S +-----------------------------------------------+ S = align64(64 + 16 * N)
           | slot 0                                        |
    S + Z  +-----------------------------------------------+
           | slot 1                                        |
           +-----------------------------------------------+
           | ...                                           |
           +-----------------------------------------------+
           | slot N-1                                      |
  S + N*Z  +-----------------------------------------------+ = file size

    (*) 0 while the file is being made; the writer stores LAYOUT_VERSION there last.

    one slot, at S + i * Z
        +0 +-----------------------------------------------+
           | seqlock counter u64, odd while being written  | SLOT_SEQ_OFFSET / SLOT_SEQ_FMT
        +8 | key                                  16 bytes | SLOT_KEY_OFFSET / SLOT_KEY_FMT
       +24 | payload length u32                            | SLOT_LEN_OFFSET / SLOT_LEN_FMT
       +28 | crc32 of the payload u32 (zlib.crc32)         | SLOT_CRC_OFFSET / SLOT_CRC_FMT
       +32 +-----------------------------------------------+ SLOT_PAYLOAD_OFFSET
           | msgpack map:                                  |
           |   "key": bytes (16)   "vector": bytes (LE f32)|
           |   "hidden_size": int  "position": int         |
           |   "num_prompt_tokens": int   "model": str     |
           +-----------------------------------------------+
           | unused up to Z                                |
        +Z +-----------------------------------------------+

Publishing one record (slot = counter % N): zero the slot's index entry -> seq := seq+1 (odd)
-> key, length, crc, payload -> seq := seq+2 (even) -> index entry := key -> header publish
counter += 1.

Looking one up: one ``mmap.find(key, index_start, index_end)`` (a match not aligned to a
16-byte entry is skipped by searching again after it); for an aligned hit, read the slot's seq
(must be even), check the slot key, CRC the payload and decode it straight out of the mapping,
re-read the seq (must be unchanged), then require payload ``key`` == requested key and
``4 * hidden_size == len(vector)``. Anything else is a miss (``None``), never another
request's record. The seq and publish counter are stored with the host's native 8-byte
``memcpy`` (``struct`` native mode, little-endian hosts) so they are single aligned stores.
On weakly ordered CPUs Python issues no memory fences; the CRC and the two key checks are the
backstop there.

A file that shrinks under a live mapping would make reads fault (SIGBUS), so every lookup
first compares ``os.fstat`` of the open file against the mapped size and raises
:class:`RingFormatError` if it shrank. The writer never truncates: a restarted writer makes a
new file and puts it in place of the old name (``link()``, or ``rename()`` over a dead
writer's file), so existing mappings stay valid.

Liveness: the writer holds an exclusive ``flock`` on its file for its lifetime. It takes the
lock on the temporary file, before the file gets its name, and the kernel drops it when the
writer closes or its process exits in any way (SIGKILL included). A reader probes with a
non-blocking *shared* ``flock`` on its own descriptor (``flock`` works on read-only
descriptors, between processes, and between containers sharing the tmpfs): refused means a
writer lives; granted means none does, and the reader releases it at once. A file left behind
by a dead writer therefore stays readable but is not live (:meth:`RingDirectory.has_ring`
ignores it). A new writer replaces the file at its name only while holding an exclusive
``flock`` on that very file (so never a live writer's file: :class:`RingInUseError` instead)
and only after checking that the name still refers to it; an empty name is taken with
``link()``, which fails if another writer got there first. A reader's probe holds its shared
lock for microseconds; a new writer retries for ``IN_USE_WAIT`` seconds before concluding that
a live writer owns the name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import sys
import tempfile
import threading
import time
import weakref
import zlib
from array import array
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgpack

from .protocol import KEY_BYTES, RING_DIR_ENV

__all__ = [
    "HEADER_SIZE",
    "KEY_BYTES",
    "LAYOUT_VERSION",
    "MAGIC",
    "Record",
    "RingDirectory",
    "RingFormatError",
    "RingInUseError",
    "RingReader",
    "RingWriter",
    "ring_file_name",
    "slot_size_for",
]

logger = logging.getLogger("vllm_hidden_state_proxy.ring")

# ---------------------------------------------------------------------------------------------
# Layout constants
# ---------------------------------------------------------------------------------------------

MAGIC = b"VHSRING\x00"
LAYOUT_VERSION = 1

#: Native 8-byte format (a single memcpy in CPython's struct) where native == little-endian;
#: standard little-endian (byte-wise) otherwise. Same bytes on disk either way.
_U64_ATOMIC_FMT = "@Q" if sys.byteorder == "little" else "<Q"

HDR_MAGIC_OFFSET = 0
HDR_MAGIC_FMT = "<8s"
HDR_VERSION_OFFSET = 8
HDR_VERSION_FMT = "<I"
HDR_HEADER_SIZE_OFFSET = 12
HDR_HEADER_SIZE_FMT = "<I"
HDR_SLOT_SIZE_OFFSET = 16
HDR_SLOT_SIZE_FMT = "<I"
HDR_SLOT_COUNT_OFFSET = 20
HDR_SLOT_COUNT_FMT = "<I"
HDR_KEY_SIZE_OFFSET = 24
HDR_KEY_SIZE_FMT = "<I"
HDR_HIDDEN_SIZE_OFFSET = 28
HDR_HIDDEN_SIZE_FMT = "<I"
HDR_EPOCH_OFFSET = 32
HDR_EPOCH_FMT = "<Q"
HDR_WRITER_PID_OFFSET = 40
HDR_WRITER_PID_FMT = "<I"
HDR_RESERVED0_OFFSET = 44
HDR_RESERVED0_FMT = "<I"
HDR_PUBLISH_COUNT_OFFSET = 48
HDR_PUBLISH_COUNT_FMT = _U64_ATOMIC_FMT
HDR_RESERVED1_OFFSET = 56
HDR_RESERVED1_FMT = "<Q"
HEADER_SIZE = 64

#: Whole header in one format (version included; the writer rewrites it last).
HEADER_FMT = "<8sIIIIIIQIIQQ"

INDEX_OFFSET = HEADER_SIZE
INDEX_ENTRY_SIZE = KEY_BYTES

SLOT_ALIGN = 64
SLOT_SEQ_OFFSET = 0
SLOT_SEQ_FMT = _U64_ATOMIC_FMT
SLOT_KEY_OFFSET = 8
SLOT_KEY_FMT = f"<{KEY_BYTES}s"
SLOT_LEN_OFFSET = 24
SLOT_LEN_FMT = "<I"
SLOT_CRC_OFFSET = 28
SLOT_CRC_FMT = "<I"
SLOT_PAYLOAD_OFFSET = 32
SLOT_HEADER_SIZE = SLOT_PAYLOAD_OFFSET
#: key, length and crc read/written in one go, at SLOT_KEY_OFFSET.
SLOT_META_FMT = f"<{KEY_BYTES}sII"

#: Sanity limits a reader applies to a header before mapping anything.
MAX_SLOT_COUNT = 1 << 24
MAX_HIDDEN_SIZE = 1 << 24
MAX_SLOT_SIZE = 1 << 30

RING_FILE_PREFIX = "ring-"
RING_FILE_SUFFIX = ".bin"
_WRITER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

#: Seconds a new writer keeps trying to lock an existing ring file before concluding that a
#: live writer holds it (a reader's liveness probe holds a shared lock for microseconds).
IN_USE_WAIT = 0.2
_IN_USE_POLL = 0.005
#: Times a new writer looks again when the file at its name changed while it was checking.
_INSTALL_ATTEMPTS = 100

_HEADER = struct.Struct(HEADER_FMT)
_VERSION = struct.Struct(HDR_VERSION_FMT)
_PUBLISH_COUNT = struct.Struct(HDR_PUBLISH_COUNT_FMT)
_SEQ = struct.Struct(SLOT_SEQ_FMT)
_SLOT_META = struct.Struct(SLOT_META_FMT)
_ZERO_KEY = bytes(KEY_BYTES)


def _check_layout() -> None:
    """Import-time proof that the named offsets/formats and the packed structs agree."""
    fields = [
        (HDR_MAGIC_OFFSET, HDR_MAGIC_FMT),
        (HDR_VERSION_OFFSET, HDR_VERSION_FMT),
        (HDR_HEADER_SIZE_OFFSET, HDR_HEADER_SIZE_FMT),
        (HDR_SLOT_SIZE_OFFSET, HDR_SLOT_SIZE_FMT),
        (HDR_SLOT_COUNT_OFFSET, HDR_SLOT_COUNT_FMT),
        (HDR_KEY_SIZE_OFFSET, HDR_KEY_SIZE_FMT),
        (HDR_HIDDEN_SIZE_OFFSET, HDR_HIDDEN_SIZE_FMT),
        (HDR_EPOCH_OFFSET, HDR_EPOCH_FMT),
        (HDR_WRITER_PID_OFFSET, HDR_WRITER_PID_FMT),
        (HDR_RESERVED0_OFFSET, HDR_RESERVED0_FMT),
        (HDR_PUBLISH_COUNT_OFFSET, HDR_PUBLISH_COUNT_FMT),
        (HDR_RESERVED1_OFFSET, HDR_RESERVED1_FMT),
        (HEADER_SIZE, ""),
    ]
    for (off, fmt), (next_off, _) in itertools.pairwise(fields):
        assert off + struct.calcsize(fmt) == next_off, (off, fmt)
    assert _HEADER.size == HEADER_SIZE
    slot_fields = [
        (SLOT_SEQ_OFFSET, SLOT_SEQ_FMT),
        (SLOT_KEY_OFFSET, SLOT_KEY_FMT),
        (SLOT_LEN_OFFSET, SLOT_LEN_FMT),
        (SLOT_CRC_OFFSET, SLOT_CRC_FMT),
        (SLOT_PAYLOAD_OFFSET, ""),
    ]
    for (off, fmt), (next_off, _) in itertools.pairwise(slot_fields):
        assert off + struct.calcsize(fmt) == next_off, (off, fmt)
    assert SLOT_KEY_OFFSET + _SLOT_META.size == SLOT_PAYLOAD_OFFSET


_check_layout()


def _align(n: int, to: int = SLOT_ALIGN) -> int:
    return (n + to - 1) // to * to


def _slots_offset(slot_count: int) -> int:
    return _align(INDEX_OFFSET + slot_count * INDEX_ENTRY_SIZE)


def _file_size(slot_count: int, slot_size: int) -> int:
    return _slots_offset(slot_count) + slot_count * slot_size


def ring_file_name(writer_id: str) -> str:
    return f"{RING_FILE_PREFIX}{writer_id}{RING_FILE_SUFFIX}"


def slot_size_for(hidden_size: int, model: str) -> int:
    """Bytes per slot: slot header plus the largest payload for this shape, rounded up to 64."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise TypeError("hidden_size must be an int")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden_size must be in [1, {MAX_HIDDEN_SIZE}], got {hidden_size}")
    worst = _pack_payload(
        _ZERO_KEY, bytes(4 * hidden_size), hidden_size, (1 << 64) - 1, (1 << 64) - 1, model
    )
    return _align(SLOT_HEADER_SIZE + len(worst))


def _pack_payload(
    key: bytes, vector: bytes, hidden_size: int, position: int, num_prompt_tokens: int, model: str
) -> bytes:
    packed: bytes = msgpack.packb(
        {
            "key": key,
            "vector": vector,
            "hidden_size": hidden_size,
            "position": position,
            "num_prompt_tokens": num_prompt_tokens,
            "model": model,
        },
        use_bin_type=True,
    )
    return packed


class RingFormatError(Exception):
    """A ring file is not (or no longer) a valid, trusted ring of this layout version."""


class RingInUseError(Exception):
    """Another live writer holds the ring file this writer was to create."""


@dataclass(frozen=True, slots=True)
class Record:
    key: bytes
    vector: bytes  # little-endian float32, len == 4 * hidden_size
    hidden_size: int
    position: int  # prompt position the row was taken at (num_prompt_tokens - 1)
    num_prompt_tokens: int
    model: str

    def as_floats(self) -> list[float]:
        values = array("f")
        values.frombytes(self.vector)
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()


#: Who may own a ring file a reader accepts: one uid, several, or ``None`` (anyone).
Owners = int | Collection[int] | None


def _owners(expected: Owners) -> frozenset[int] | None:
    if expected is None:
        return None
    return frozenset((expected,)) if isinstance(expected, int) else frozenset(expected)


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------


class RingWriter:
    """Single-process writer of one ring file. ``publish`` never blocks on readers.

    Holds an exclusive ``flock`` on the file from :meth:`create` until :meth:`close` (or until
    the process exits): that lock is what readers see as "the writer is alive".
    """

    path: Path
    epoch: int

    def __init__(
        self,
        *,
        path: Path,
        fd: int,
        mm: mmap.mmap,
        epoch: int,
        hidden_size: int,
        model: str,
        slot_count: int,
        slot_size: int,
    ) -> None:
        # Use RingWriter.create(); this only wires up an already initialised mapping.
        self.path = path
        self.epoch = epoch
        self.hidden_size = hidden_size
        self.model = model
        self.slot_count = slot_count
        self.slot_size = slot_size
        self._fd: int | None = fd  # holds the liveness lock
        self._mm: mmap.mmap | None = mm
        self._vector_len = 4 * hidden_size
        self._payload_cap = slot_size - SLOT_HEADER_SIZE
        self._slots_off = _slots_offset(slot_count)
        self._count = 0
        self._lock = threading.Lock()
        # A forked child (vLLM's compile workers, any multiprocessing fork) inherits the file
        # descriptors, hence the lock: the ring would look alive after the writer died.
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _forget_after_fork(self) -> None:
        """In a forked child: drop our copies of the descriptors (without unlocking: the
        parent's lock is shared) so that only the writer process keeps the ring alive."""
        mm, self._mm = self._mm, None
        fd, self._fd = self._fd, None
        with contextlib.suppress(Exception):
            if mm is not None:
                mm.close()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        writer_id: str,
        hidden_size: int,
        model: str,
        slot_count: int,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> RingWriter:
        """Make ``<directory>/ring-<writer_id>.bin`` and hold its liveness lock.

        Replaces a file left there by a writer that is gone; raises :class:`RingInUseError`
        (and leaves everything as it was) if a live writer holds the file at that name.
        """
        if not isinstance(writer_id, str) or not _WRITER_ID_RE.fullmatch(writer_id):
            raise ValueError(f"writer_id must match {_WRITER_ID_RE.pattern} (got {writer_id!r})")
        if not isinstance(model, str):
            raise TypeError("model must be a str")
        model.encode("utf-8")  # surrogates would fail later, in publish; fail here instead
        if isinstance(slot_count, bool) or not isinstance(slot_count, int):
            raise TypeError("slot_count must be an int")
        if not 1 <= slot_count <= MAX_SLOT_COUNT:
            raise ValueError(f"slot_count must be in [1, {MAX_SLOT_COUNT}], got {slot_count}")
        if file_mode & 0o022:
            raise ValueError(
                f"file_mode {file_mode:#o} is group/other-writable; readers refuse such files"
            )
        slot_size = slot_size_for(hidden_size, model)
        if slot_size > MAX_SLOT_SIZE:
            raise ValueError(f"slot size {slot_size} exceeds {MAX_SLOT_SIZE} (model name?)")
        total = _file_size(slot_count, slot_size)

        d = Path(directory)
        try:
            os.makedirs(d, mode=dir_mode)
        except FileExistsError:
            pass
        else:
            os.chmod(d, dir_mode)  # makedirs' mode is filtered through the umask

        final = d / ring_file_name(writer_id)
        epoch = secrets.randbits(64) or 1
        fd, tmp_name = tempfile.mkstemp(prefix=f".ring-{writer_id}.", suffix=".tmp", dir=d)
        mm: mmap.mmap | None = None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else has it
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot lock a new ring file in {d}: {exc.strerror}"
                ) from exc
            os.fchmod(fd, file_mode)
            _reserve(fd, total, d)
            mm = mmap.mmap(fd, total)
            _HEADER.pack_into(
                mm,
                0,
                MAGIC,
                0,  # layout version: not ready yet
                HEADER_SIZE,
                slot_size,
                slot_count,
                KEY_BYTES,
                hidden_size,
                epoch,
                os.getpid() & 0xFFFFFFFF,
                0,
                0,
                0,
            )
            _VERSION.pack_into(mm, HDR_VERSION_OFFSET, LAYOUT_VERSION)  # ready flag, last
            _install(tmp_name, final, writer_id)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)  # releases the lock
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        logger.info(
            "created ring file %s (epoch %016x, %d slots x %d bytes, hidden_size %d)",
            final,
            epoch,
            slot_count,
            slot_size,
            hidden_size,
        )
        return cls(
            path=final,
            fd=fd,
            mm=mm,
            epoch=epoch,
            hidden_size=hidden_size,
            model=model,
            slot_count=slot_count,
            slot_size=slot_size,
        )

    @property
    def publish_count(self) -> int:
        return self._count

    def publish(self, key: bytes, vector: bytes, *, position: int, num_prompt_tokens: int) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes")
        if key == _ZERO_KEY:
            raise ValueError("the all-zero key marks empty index entries and cannot be used")
        if len(vector) != self._vector_len:
            raise ValueError(
                f"vector must be {self._vector_len} bytes (float32 x {self.hidden_size}), "
                f"got {len(vector)}"
            )
        for name, value in (("position", position), ("num_prompt_tokens", num_prompt_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int")
            if not -(1 << 63) <= value < (1 << 64):
                raise ValueError(f"{name} out of 64-bit range")
        payload = _pack_payload(
            key, vector, self.hidden_size, position, num_prompt_tokens, self.model
        )
        n = len(payload)
        if n > self._payload_cap:  # cannot happen given slot_size_for; keep the file sane
            raise ValueError(f"payload of {n} bytes exceeds the slot capacity {self._payload_cap}")
        crc = zlib.crc32(payload)
        with self._lock:
            mm = self._mm
            if mm is None:
                raise ValueError("ring writer is closed")
            count = self._count
            slot = count % self.slot_count
            idx = INDEX_OFFSET + slot * INDEX_ENTRY_SIZE
            off = self._slots_off + slot * self.slot_size
            mm[idx : idx + KEY_BYTES] = _ZERO_KEY
            seq = _SEQ.unpack_from(mm, off)[0] | 1  # odd: writer at work
            _SEQ.pack_into(mm, off, seq)
            _SLOT_META.pack_into(mm, off + SLOT_KEY_OFFSET, key, n, crc)
            start = off + SLOT_PAYLOAD_OFFSET
            mm[start : start + n] = payload
            _SEQ.pack_into(mm, off, (seq + 1) & 0xFFFFFFFFFFFFFFFF)  # even: done
            mm[idx : idx + KEY_BYTES] = key
            self._count = count + 1
            _PUBLISH_COUNT.pack_into(mm, HDR_PUBLISH_COUNT_OFFSET, self._count)

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

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _forget_in_child(ref: weakref.ReferenceType[RingWriter]) -> None:
    writer = ref()
    if writer is not None:
        writer._forget_after_fork()


def _flock_nb(fd: int, operation: int) -> bool:
    """Non-blocking ``flock``: True if granted, False if another open file holds a conflict."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _flock_retrying(fd: int, operation: int, seconds: float) -> bool:
    """:func:`_flock_nb`, retried for ``seconds`` (readers' probes hold brief shared locks)."""
    deadline = time.monotonic() + seconds
    while not _flock_nb(fd, operation):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_IN_USE_POLL)
    return True


def _install(tmp_name: str, final: Path, writer_id: str) -> None:
    """Give the ready, locked temp file the name ``final`` unless a live writer holds that name.

    A free name is taken with ``link()`` (fails if another writer took it first); an existing
    file is replaced only while we hold an exclusive ``flock`` on it and the name still refers
    to it, so two writers starting together never both succeed.
    """
    for _ in range(_INSTALL_ATTEMPTS):
        try:
            old = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                os.link(tmp_name, final)
            except FileExistsError:
                continue  # another writer was faster: check its file
            except OSError:
                os.replace(tmp_name, final)  # no hard links on this file system
                return
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                os.replace(tmp_name, final)  # a symlink (readers refuse those): replace it
                return
            raise OSError(
                exc.errno,
                f"cannot open the existing {final} to check whether a live writer holds it: "
                f"{exc.strerror}; remove it if no vLLM is publishing there",
            ) from exc
        try:
            st = os.fstat(old)
            if not stat.S_ISREG(st.st_mode):
                os.replace(tmp_name, final)  # not a ring file; a directory makes this fail
                return
            if not _flock_retrying(old, fcntl.LOCK_EX, IN_USE_WAIT):
                raise RingInUseError(
                    f"{final} is held by a live writer: another vLLM instance (or another "
                    f"rank with writer id {writer_id!r}) is publishing hidden states there. "
                    f"Give each vLLM its own ring directory ({RING_DIR_ENV})."
                )
            try:
                now = os.stat(final, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.replace(tmp_name, final)  # still under our lock: nobody else replaces it
                return
        finally:
            os.close(old)  # releases our lock on the old file
    raise RingInUseError(
        f"{final} kept being replaced while this writer (id {writer_id!r}) was starting: "
        f"several vLLM instances (or ranks) are publishing there. Give each vLLM its own ring "
        f"directory ({RING_DIR_ENV})."
    )


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
    except AttributeError:  # pragma: no cover - platforms without posix_fallocate
        os.ftruncate(fd, size)


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------


class RingReader:
    """Read-only view of one ring file. Not safe to ``close()`` while another thread looks up."""

    path: Path
    epoch: int

    def __init__(
        self,
        *,
        path: Path,
        fd: int,
        mm: mmap.mmap,
        st: os.stat_result,
        epoch: int,
        hidden_size: int,
        slot_count: int,
        slot_size: int,
        writer_pid: int,
    ) -> None:
        # Use RingReader.open().
        self.path = path
        self.epoch = epoch
        self.writer_pid = writer_pid
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._dev = st.st_dev
        self._ino = st.st_ino
        self._hidden_size = hidden_size
        self._slot_count = slot_count
        self._slot_size = slot_size
        self._size = len(mm)
        self._index_end = INDEX_OFFSET + slot_count * INDEX_ENTRY_SIZE
        self._slots_off = _slots_offset(slot_count)
        self._payload_cap = slot_size - SLOT_HEADER_SIZE
        self._probe_error_logged = False

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, expected_uid: Owners = None) -> RingReader:
        """Open and validate a ring file; :class:`RingFormatError` on any problem.

        ``expected_uid``: the uid (or uids) the file must belong to; ``None`` accepts any.
        """
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise RingFormatError(f"{p}: cannot open: {exc.strerror or exc}") from exc
        try:
            return cls._open_fd(p, fd, expected_uid)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _open_fd(cls, p: Path, fd: int, expected_uid: Owners) -> RingReader:
        def bad(reason: str) -> RingFormatError:
            return RingFormatError(f"{p}: {reason}")

        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise bad("not a regular file")
            if st.st_mode & 0o022:
                raise bad(
                    f"mode {stat.S_IMODE(st.st_mode):#o} is writable by group/others; refusing"
                )
            owners = _owners(expected_uid)
            if owners is not None and st.st_uid not in owners:
                expected = " or ".join(str(uid) for uid in sorted(owners))
                raise bad(f"owned by uid {st.st_uid}, expected uid {expected}; refusing")
            raw = os.pread(fd, HEADER_SIZE, 0)
            if len(raw) < HEADER_SIZE:
                raise bad(f"truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
            (
                magic,
                version,
                header_size,
                slot_size,
                slot_count,
                key_size,
                hidden_size,
                epoch,
                writer_pid,
                _reserved0,
                _publish_count,
                _reserved1,
            ) = _HEADER.unpack(raw)
            if magic != MAGIC:
                raise bad(f"bad magic {magic!r} (expected {MAGIC!r})")
            if version == 0:
                raise bad("not ready (layout version 0: the writer has not finished creating it)")
            if version != LAYOUT_VERSION:
                raise bad(f"unsupported layout version {version} (expected {LAYOUT_VERSION})")
            if header_size != HEADER_SIZE:
                raise bad(f"header size {header_size} (expected {HEADER_SIZE})")
            if key_size != KEY_BYTES:
                raise bad(f"key size {key_size} (expected {KEY_BYTES})")
            if not 1 <= slot_count <= MAX_SLOT_COUNT:
                raise bad(f"slot count {slot_count} out of range [1, {MAX_SLOT_COUNT}]")
            if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
                raise bad(f"hidden size {hidden_size} out of range [1, {MAX_HIDDEN_SIZE}]")
            min_slot = slot_size_for(hidden_size, "")
            if slot_size % SLOT_ALIGN or not min_slot <= slot_size <= MAX_SLOT_SIZE:
                raise bad(
                    f"slot size {slot_size} invalid for hidden size {hidden_size} "
                    f"(need a multiple of {SLOT_ALIGN} in [{min_slot}, {MAX_SLOT_SIZE}])"
                )
            total = _file_size(slot_count, slot_size)
            if st.st_size != total:
                raise bad(
                    f"file is {st.st_size} bytes but the header describes {total} "
                    f"({slot_count} slots x {slot_size} bytes)"
                )
            mm = mmap.mmap(fd, total, access=mmap.ACCESS_READ)
        except RingFormatError:
            raise
        except (OSError, ValueError, OverflowError) as exc:
            raise bad(f"cannot read/map: {exc}") from exc
        try:
            if os.fstat(fd).st_size < total:
                raise bad("file shrank while opening")
        except BaseException:
            mm.close()
            raise
        return cls(
            path=p,
            fd=fd,
            mm=mm,
            st=st,
            epoch=epoch,
            hidden_size=hidden_size,
            slot_count=slot_count,
            slot_size=slot_size,
            writer_pid=writer_pid,
        )

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def slot_count(self) -> int:
        return self._slot_count

    @property
    def slot_size(self) -> int:
        return self._slot_size

    @property
    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the mapped file."""
        return (self._dev, self._ino)

    @property
    def publish_count(self) -> int:
        """Total records published so far (diagnostics)."""
        mm = self._mm
        if mm is None:
            return 0
        self._check_size()
        value: int = _PUBLISH_COUNT.unpack_from(mm, HDR_PUBLISH_COUNT_OFFSET)[0]
        return value

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

    def lookup(self, key: bytes) -> Record | None:
        """The record published under ``key``, or ``None``.

        Raises :class:`RingFormatError` only if the file shrank under the mapping.
        """
        mm = self._mm
        if mm is None or not isinstance(key, bytes) or len(key) != KEY_BYTES or key == _ZERO_KEY:
            return None
        self._check_size()
        key = bytes(key)  # a bytes subclass could override __eq__
        start = INDEX_OFFSET
        end = self._index_end
        pos = mm.find(key, start, end)
        while pos >= 0:
            rel = pos - start
            if rel % INDEX_ENTRY_SIZE:
                pos = mm.find(key, pos + 1, end)  # straddles two entries: not a real entry
                continue
            record = self._read_slot(rel // INDEX_ENTRY_SIZE, key)
            if record is not None:
                return record
            pos = mm.find(key, pos + INDEX_ENTRY_SIZE, end)
        return None

    def _read_slot(self, slot: int, key: bytes) -> Record | None:
        mm = self._mm
        mv = self._mv
        if mm is None or mv is None:
            return None
        off = self._slots_off + slot * self._slot_size
        seq = _SEQ.unpack_from(mm, off)[0]
        if seq & 1:
            return None  # writer is working on this slot
        slot_key, n, crc = _SLOT_META.unpack_from(mm, off + SLOT_KEY_OFFSET)
        if slot_key != key or n > self._payload_cap:
            return None
        start = off + SLOT_PAYLOAD_OFFSET
        with mv[start : start + n] as payload:
            if zlib.crc32(payload) != crc:
                return None
            try:
                obj = msgpack.unpackb(payload, raw=False)
            except Exception:
                return None
        if _SEQ.unpack_from(mm, off)[0] != seq:
            return None  # overwritten while we read it
        return self._to_record(obj, key)

    def _to_record(self, obj: Any, key: bytes) -> Record | None:
        if type(obj) is not dict:
            return None
        rkey = obj.get("key")
        vector = obj.get("vector")
        hidden_size = obj.get("hidden_size")
        position = obj.get("position")
        num_prompt_tokens = obj.get("num_prompt_tokens")
        model = obj.get("model")
        if (
            type(rkey) is not bytes
            or rkey != key
            or type(vector) is not bytes
            or type(hidden_size) is not int
            or hidden_size != self._hidden_size
            or 4 * hidden_size != len(vector)
            or type(position) is not int
            or type(num_prompt_tokens) is not int
            or type(model) is not str
        ):
            return None
        return Record(
            key=rkey,
            vector=vector,
            hidden_size=hidden_size,
            position=position,
            num_prompt_tokens=num_prompt_tokens,
            model=model,
        )

    def is_live(self) -> bool:
        """True while a writer holds this file's liveness lock (its process is alive).

        A non-blocking probe: a shared ``flock`` on our own descriptor is refused exactly while
        a writer holds its exclusive one; if granted, it is released at once. False for a
        closed reader. Another probe error (no locking on this file system) counts as live,
        since nothing can then be told apart.
        """
        fd = self._fd
        if fd is None:
            return False
        try:
            granted = _flock_nb(fd, fcntl.LOCK_SH)
        except OSError as exc:
            if not self._probe_error_logged:
                self._probe_error_logged = True
                logger.warning("cannot probe ring file %s for a live writer: %s", self.path, exc)
            return True
        if not granted:
            return True
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def is_stale(self) -> bool:
        """True if ``self.path`` is gone or now names a different file than the one mapped."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != (self._dev, self._ino)

    def close(self) -> None:
        mv, self._mv = self._mv, None
        mm, self._mm = self._mm, None
        fd, self._fd = self._fd, None
        if mv is not None:
            mv.release()
        if mm is not None:
            # BufferError: a slice is still referenced (e.g. by a traceback); GC unmaps it.
            with contextlib.suppress(BufferError):
                mm.close()
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> RingReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Directory of rings (proxy side)
# ---------------------------------------------------------------------------------------------

_StatSig = tuple[int, int, int, int, int, int, int]


def _stat_sig(st: os.stat_result) -> _StatSig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid)


class RingDirectory:
    """Every ``ring-*.bin`` in a directory; follows writers that restart (new file, new epoch).

    A ring is *live* while its writer holds the file's lock (see :meth:`RingReader.is_live`).
    Rings whose writer is gone stay mapped and searchable until their file is replaced or
    removed, but :meth:`has_ring`, :meth:`publish_count` and :meth:`min_slot_count` only count
    live ones. Thread-safe (one lock around scans, probes and lookups).
    """

    #: Minimum seconds between two directory checks triggered by lookups.
    CHECK_INTERVAL = 0.05
    #: Seconds a "some ring is live" answer is reused before the writers are probed again.
    LIVENESS_INTERVAL = 0.1

    def __init__(self, directory: str | os.PathLike[str], *, expected_uid: Owners = None) -> None:
        self.directory = Path(directory)
        self._expected_uid = expected_uid
        self._readers: dict[str, RingReader] = {}
        self._listing: dict[str, int] = {}
        self._refused: dict[str, _StatSig] = {}
        self._lock = threading.RLock()
        self._next_check = 0.0
        self._closed = False
        self._dir_error_logged = False
        self._live: tuple[RingReader, ...] = ()
        self._live_until = 0.0
        self._dead_logged: set[tuple[int, int]] = set()
        self.refresh()

    # -- scanning ---------------------------------------------------------------------------

    def _iter_ring_entries(self) -> Iterator[os.DirEntry[str]]:
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            return
        except OSError as exc:
            if not self._dir_error_logged:
                logger.warning("cannot list ring directory %s: %s", self.directory, exc)
                self._dir_error_logged = True
            return
        with it:
            for entry in it:
                name = entry.name
                if name.startswith(RING_FILE_PREFIX) and name.endswith(RING_FILE_SUFFIX):
                    yield entry

    def _quick_listing(self) -> dict[str, int]:
        return {entry.name: entry.inode() for entry in self._iter_ring_entries()}

    def refresh(self) -> None:
        """Rescan: open new ring files, drop replaced/removed ones, log each refusal once."""
        with self._lock:
            if self._closed:
                return
            stats: dict[str, os.stat_result] = {}
            for entry in self._iter_ring_entries():
                try:
                    stats[entry.name] = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished between readdir and stat
            for name, reader in list(self._readers.items()):
                st = stats.get(name)
                if st is None or (st.st_dev, st.st_ino) != reader.identity or reader.is_stale():
                    logger.info(
                        "ring file %s %s (epoch %016x); dropping it",
                        reader.path,
                        "removed" if st is None else "replaced",
                        reader.epoch,
                    )
                    reader.close()
                    del self._readers[name]
            for name in list(self._refused):
                if name not in stats:
                    del self._refused[name]
            for name, st in stats.items():
                if name in self._readers:
                    continue
                sig = _stat_sig(st)
                if self._refused.get(name) == sig:
                    continue  # same bad file as last time: already logged
                try:
                    reader = RingReader.open(self.directory / name, expected_uid=self._expected_uid)
                except RingFormatError as exc:
                    self._refused[name] = sig
                    logger.warning("refusing ring file %s", exc)
                    continue
                self._refused.pop(name, None)
                self._readers[name] = reader
                logger.info(
                    "opened ring file %s (epoch %016x, writer pid %d, %d slots, hidden_size %d)",
                    reader.path,
                    reader.epoch,
                    reader.writer_pid,
                    reader.slot_count,
                    reader.hidden_size,
                )
            self._listing = {name: st.st_ino for name, st in stats.items()}
            self._next_check = time.monotonic() + self.CHECK_INTERVAL
            self._forget_liveness()
            current = {reader.identity for reader in self._readers.values()}
            self._dead_logged &= current

    def _changed(self) -> bool:
        if self._refused:
            return True  # let refresh() re-stat refused files (it only reopens changed ones)
        listing = self._quick_listing()
        if listing != self._listing:
            return True
        return any(reader.is_stale() for reader in self._readers.values())

    def _drop_broken(self, name: str, reader: RingReader, exc: RingFormatError) -> None:
        logger.warning("refusing ring file %s", exc)
        reader.close()
        self._readers.pop(name, None)
        self._forget_liveness()
        with contextlib.suppress(OSError):
            self._refused[name] = _stat_sig(os.stat(reader.path, follow_symlinks=False))

    def _search(self, key: bytes) -> tuple[Record | None, RingReader | None]:
        for name, reader in list(self._readers.items()):
            try:
                record = reader.lookup(key)
            except RingFormatError as exc:
                self._drop_broken(name, reader, exc)
                continue
            if record is not None:
                return record, reader
        return None, None

    # -- liveness ----------------------------------------------------------------------------

    def _forget_liveness(self) -> None:
        self._live = ()
        self._live_until = 0.0

    def _live_readers(self) -> tuple[RingReader, ...]:
        """Mapped rings whose writer is alive; a non-empty answer is reused for a while."""
        if self._live and time.monotonic() < self._live_until:
            return self._live
        live: list[RingReader] = []
        for reader in self._readers.values():
            if reader.is_live():
                live.append(reader)
            elif reader.identity not in self._dead_logged:
                self._dead_logged.add(reader.identity)
                logger.info(
                    "ring file %s (epoch %016x): its writer (pid %d) is gone; not counting it "
                    "as an active worker hook",
                    reader.path,
                    reader.epoch,
                    reader.writer_pid,
                )
        self._live = tuple(live)
        self._live_until = time.monotonic() + self.LIVENESS_INTERVAL
        return self._live

    # -- public API --------------------------------------------------------------------------

    def has_ring(self) -> bool:
        """True if at least one ring's writer is alive (rescans the directory if none is).

        A True answer is reused for up to ``LIVENESS_INTERVAL`` seconds, so a writer that has
        just died can still count as live for that long.
        """
        with self._lock:
            if self._closed:
                return False
            if self._live_readers():
                return True
            self.refresh()  # a writer may have started since (perhaps replacing a dead file)
            return bool(self._live_readers())

    def publish_count(self) -> int:
        """Sum of the publish counters of the mapped live rings (a header read each).

        For telling "overwritten" from "never published": if a record was not found and this
        sum grew by less than :meth:`min_slot_count` since its request was forwarded, no ring
        has reused a slot since, so the record was never published there. The sum drops when a
        writer dies or restarts (a new file counts from 0); its records are gone with it.
        """
        with self._lock:
            if self._closed:
                return 0
            total = 0
            for reader in self._live_readers():
                try:
                    total += reader.publish_count
                except RingFormatError as exc:
                    self._drop_broken(reader.path.name, reader, exc)
            return total

    def min_slot_count(self) -> int | None:
        """The smallest slot count among the live rings; ``None`` if no ring is live."""
        with self._lock:
            if self._closed:
                return None
            return min((reader.slot_count for reader in self._live_readers()), default=None)

    def lookup(self, key: bytes) -> Record | None:
        """Search the mapped rings; at most every ~50 ms, notice restarts/new files and rescan.

        A record found in a file that has since been replaced is dropped once the periodic
        check notices the replacement.
        """
        with self._lock:
            if self._closed:
                return None
            record, source = self._search(key)
            now = time.monotonic()
            if now < self._next_check:
                return record
            self._next_check = now + self.CHECK_INTERVAL
            if not self._changed():
                return record
            self.refresh()
            if source is not None and self._readers.get(source.path.name) is source:
                return record  # found in a file that is still current
            return self._search(key)[0]

    def hidden_size(self) -> int | None:
        """The vector length of the live rings (all serve one model); ``None`` if none is live."""
        with self._lock:
            if self._closed:
                return None
            return next((reader.hidden_size for reader in self._live_readers()), None)

    @property
    def epochs(self) -> dict[str, int]:
        with self._lock:
            return {name: reader.epoch for name, reader in self._readers.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            self._forget_liveness()

    def __enter__(self) -> RingDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
