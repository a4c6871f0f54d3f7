"""Every ring of a directory, as the proxy sees it: one per engine, of one or more vLLM servers.

A request may be served by any engine, so a lookup searches every mapped ring (each search is
a dictionary probe, see :mod:`.reader`). The directory follows engines that start, restart
(new file) or die, and the failure notes of engines whose hook could not start
(:mod:`.notes`).

The directory itself is checked first (:func:`.files.open_directory`: a real directory, owned
by a trusted user, not world-writable) on every rescan and liveness probe: a refused directory
is not read at all (its rings are dropped), the reason is logged once and given by
:meth:`RingDirectory.refusal`, and it is checked again until it passes (a disk-backed Kubernetes
emptyDir is world-writable until vLLM's hook, its owner, fixes it; a memory-backed one is
sticky too, and the chart's init container fixes it).

A ring is *live* while its writer holds the file's lock. Rings whose writer is gone stay mapped
and searchable until their file is removed (a record published just before a crash can still
be read), but only live ones count as publishing. Thread-safe: one lock around scans, probes
and lookups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from vllm_hidden_state_proxy.protocol import RING_DIR_ENV
from vllm_hidden_state_proxy.ring.closing import ClosesOnExit
from vllm_hidden_state_proxy.ring.files import (
    NOTE_SUFFIX,
    RING_SUFFIX,
    Owners,
    UntrustedDirectory,
    check_directory,
    files_named,
    owners,
    parse_name,
    self_and_root,
)
from vllm_hidden_state_proxy.ring.layout import (
    RingFormatError,
    RingHeader,
    RingShape,
)
from vllm_hidden_state_proxy.ring.notes import EngineFailure, read_live_note
from vllm_hidden_state_proxy.ring.reader import PendingRows, RingReader
from vllm_hidden_state_proxy.ring.records import (
    Found,
)

logger = logging.getLogger("vllm_hidden_state_proxy.ring")

_StatSig = tuple[int, int, int, int, int, int, int]
#: Publish counters of the live rings at one moment, by file identity.
PublishMarks = Mapping[tuple[int, int], int]


def _stat_sig(st: os.stat_result) -> _StatSig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid)


class RingDirectoryConflict(Exception):
    """Another vLLM server publishes in this directory rings of another shape (the message says
    why that cannot work and what to change)."""


def _live_shapes_of_others(directory: Path, instance: int) -> list[tuple[int, RingShape]]:
    """(instance, shape) of the live rings of other instances, read quietly: this runs in a
    vLLM engine, whose log should not fill with a proxy's notes about the directory."""
    shapes = []
    for path, owner in files_named(directory, RING_SUFFIX):
        if owner == instance:
            continue
        try:
            reader = RingReader.open(path)
        except RingFormatError:
            continue  # not a ring anyone can use: no conflict
        with reader:
            if reader.is_live():
                shapes.append((reader.header.instance, reader.shape))
    return shapes


def check_shareable(
    directory: Path, *, instance: int, hidden_size: int, num_hidden_layers: int
) -> None:
    """Raise :class:`RingDirectoryConflict` if a live ring of another vLLM server (instance) in
    ``directory`` holds vectors of another hidden size or layer count.

    Servers of one model can share a directory: each proxy finds its own request keys in any
    ring, and asks for layers every ring captures. Rings of different models cannot: a proxy
    would not know which one's ``-1`` or hidden size its requests get. Call it with
    :func:`.files.directory_locked` held, before creating the ring.
    """
    for other, shape in _live_shapes_of_others(directory, instance):
        if shape.model_dims != (hidden_size, num_hidden_layers):
            raise RingDirectoryConflict(
                f"the ring directory {directory} is shared with another vLLM server (instance "
                f"{other:016x}) whose model has hidden size {shape.hidden_size} and "
                f"{shape.num_hidden_layers} layers, where this one's has {hidden_size} and "
                f"{num_hidden_layers}: a proxy could not tell whose rings are whose. Give each "
                f"vLLM server its own ring directory ({RING_DIR_ENV}; serve --ring-dir)"
            )


class RingDirectory(ClosesOnExit):
    """Every ``ring-*.bin`` and ``ring-*.failed`` in a directory."""

    #: Minimum seconds between two directory checks triggered by lookups.
    CHECK_INTERVAL = 0.05
    #: Seconds a liveness answer (rings and notes) is reused before probing again.
    LIVENESS_INTERVAL = 0.1

    def __init__(self, directory: str | os.PathLike[str], *, owner_uids: Owners = None) -> None:
        self.directory = Path(directory)
        self._owner_uids = owner_uids
        # Who may own the directory: the rings' trusted owners, and also root and this user,
        # who could change whatever this process reads anyway.
        trusted = owners(owner_uids)
        self._directory_owners = None if trusted is None else trusted | self_and_root()
        self._readers: dict[str, RingReader] = {}
        self._listing: dict[str, int] = {}
        self._refused: dict[str, _StatSig] = {}
        self._lock = threading.RLock()
        self._next_check = 0.0
        self._closed = False
        self._dir_error_logged = False
        self._live: tuple[RingReader, ...] = ()
        self._failures: tuple[EngineFailure, ...] = ()
        self._live_until = 0.0
        self._dead_logged: set[tuple[int, int]] = set()
        self._failures_logged: set[tuple[int, int, int]] = set()
        #: Why the directory itself is refused (nothing in it is read), or None.
        self._refusal: str | None = None
        self.refresh()

    # -- scanning ------------------------------------------------------------------------------

    def _entries(self) -> Iterator[os.DirEntry[str]]:
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
                if parse_name(entry.name) is not None:
                    yield entry

    def _trusted(self) -> bool:
        """Check the directory itself; a refusal drops every ring and is logged once."""
        try:
            check_directory(self.directory, owner_uids=self._directory_owners, dir_mode=None)
        except FileNotFoundError:
            refusal = None  # no hook has made it yet: nothing to read, nothing to refuse
        except UntrustedDirectory as exc:
            refusal = str(exc)
        else:
            refusal = None
        if refusal is None:
            if self._refusal is not None:
                logger.info("the ring directory %s passes its checks now", self.directory)
                self._refusal = None
            return True
        if refusal != self._refusal:
            # A warning: where the hook repairs the directory (a new Kubernetes emptyDir) this
            # is a proxy that started first, and "passes its checks now" follows.
            logger.warning("refusing %s (checked again until it passes)", refusal)
            self._refusal = refusal
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._listing = {}
        self._forget_liveness()
        return False

    def refresh(self) -> None:
        """Rescan: open new ring files, drop replaced/removed ones, log each refusal once."""
        with self._lock:
            if self._closed:
                return
            if not self._trusted():
                self._next_check = time.monotonic() + self.CHECK_INTERVAL
                return
            stats: dict[str, os.stat_result] = {}
            for entry in self._entries():
                with contextlib.suppress(OSError):  # vanished between readdir and stat
                    stats[entry.name] = entry.stat(follow_symlinks=False)
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
                if name in self._readers or not name.endswith(RING_SUFFIX):
                    continue
                sig = _stat_sig(st)
                if self._refused.get(name) == sig:
                    continue  # the same bad file as last time: already logged
                try:
                    reader = RingReader.open(self.directory / name, owner_uids=self._owner_uids)
                except RingFormatError as exc:
                    self._refused[name] = sig
                    logger.warning("refusing ring file %s", exc)
                    continue
                self._refused.pop(name, None)
                self._readers[name] = reader
                logger.info(
                    "opened ring file %s (engine %d, epoch %016x, writer pid %d, %d slots, "
                    "hidden_size %d, layers %s)",
                    reader.path,
                    reader.header.engine,
                    reader.epoch,
                    reader.header.writer_pid,
                    reader.slot_count,
                    reader.hidden_size,
                    ",".join(map(str, reader.layers)),
                )
            self._listing = {name: st.st_ino for name, st in stats.items()}
            self._next_check = time.monotonic() + self.CHECK_INTERVAL
            self._forget_liveness()
            self._dead_logged &= {reader.identity for reader in self._readers.values()}

    def _changed(self) -> bool:
        if self._refused or self._refusal is not None:
            return True  # let refresh() re-stat refused files (it only reopens changed ones)
        listing = {entry.name: entry.inode() for entry in self._entries()}
        if listing != self._listing:
            return True
        return any(reader.is_stale() for reader in self._readers.values())

    def _maybe_refresh(self) -> bool:
        """Rescan if the periodic check is due and the directory changed; True if it did."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.CHECK_INTERVAL
        if not self._changed():
            return False
        self.refresh()
        return True

    def _drop_broken(self, name: str, reader: RingReader, exc: RingFormatError) -> None:
        logger.warning("refusing ring file %s", exc)
        reader.close()
        self._readers.pop(name, None)
        self._forget_liveness()
        with contextlib.suppress(OSError):
            self._refused[name] = _stat_sig(os.stat(reader.path, follow_symlinks=False))

    def _search(self, key: bytes) -> tuple[Found | PendingRows | None, RingReader | None]:
        for name, reader in list(self._readers.items()):
            try:
                found = reader.find(key)
            except RingFormatError as exc:
                self._drop_broken(name, reader, exc)
                continue
            if found is not None:
                return found, reader
        return None, None

    def _recheck(self) -> bool:
        """Re-read the index entries each ring may have read stale (see :mod:`.reader`, *Memory
        ordering*); True if any ring's key map changed."""
        return [reader.recheck() for reader in self._readers.values()].count(True) > 0

    # -- liveness ------------------------------------------------------------------------------

    def _forget_liveness(self) -> None:
        self._live = ()
        self._failures = ()
        self._live_until = 0.0

    def _probe(self) -> None:
        """Which mapped rings have a live writer, and which engines hold a failure note instead;
        reused for ``LIVENESS_INTERVAL``."""
        if time.monotonic() < self._live_until:
            return
        if not self._trusted():  # a directory that turned untrusted since the last rescan
            self._live_until = time.monotonic() + self.LIVENESS_INTERVAL
            return
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
                    reader.header.writer_pid,
                )
        publishing = {(reader.header.instance, reader.header.engine) for reader in live}
        failures = []
        for name in self._listing:
            if not name.endswith(NOTE_SUFFIX):
                continue
            failure = read_live_note(self.directory / name, self._owner_uids)
            if failure is None or (failure.instance, failure.engine) in publishing:
                continue
            failures.append(failure)
            seen = (failure.instance, failure.engine, failure.pid)
            if seen not in self._failures_logged:
                self._failures_logged.add(seen)
                logger.error("no ring for %s", failure.describe())
        self._live = tuple(live)
        self._failures = tuple(sorted(failures, key=lambda f: (f.instance, f.engine)))
        self._live_until = time.monotonic() + self.LIVENESS_INTERVAL

    # -- public API ----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> Found | None:
        """The record (or error record) published under ``key`` in any mapped ring, or ``None``."""
        found = self.find(key)
        return found.load() if isinstance(found, PendingRows) else found

    def find(self, key: bytes) -> Found | PendingRows | None:
        """As :meth:`lookup`, but a large matrix's rows are left for :meth:`PendingRows.load`,
        to be copied outside this directory's lock (see :mod:`.reader`).

        On a miss, re-reads the index entries a weakly ordered CPU may have shown stale, and
        searches again if that changed anything. At most every ~50 ms, notices new, restarted
        and removed rings and searches again.
        """
        with self._lock:
            if self._closed:
                return None
            found, source = self._search(key)
            if found is None and self._recheck():
                found, source = self._search(key)  # an index entry had been read stale
            if not self._maybe_refresh():
                return found
            if source is not None and self._readers.get(source.path.name) is source:
                return found  # found in a file that is still current
            return self._search(key)[0]

    def _probed(self, refresh: bool = False) -> bool:
        """Under the lock: False if closed; else probed (:meth:`_probe`), after a rescan if
        ``refresh`` and one is due (:meth:`_maybe_refresh`), and True."""
        if self._closed:
            return False
        if refresh:
            self._maybe_refresh()
        self._probe()
        return True

    def has_ring(self) -> bool:
        """True if at least one ring's writer is alive (rescans the directory if none is).

        A True answer is reused for up to ``LIVENESS_INTERVAL`` seconds, so a writer that has
        just died can still count as live for that long.
        """
        with self._lock:
            if not self._probed():
                return False
            if self._live:
                return True
            self.refresh()  # a writer may have started since
            self._probe()
            return bool(self._live)

    def live_ring_count(self) -> int:
        with self._lock:
            if not self._probed(refresh=True):
                return 0
            return len(self._live)

    def live_shapes(self) -> tuple[RingShape, ...]:
        """The shapes (hidden size, captured layers, ...) of the live rings."""
        with self._lock:
            if not self._probed():
                return ()
            return tuple(reader.shape for reader in self._live)

    def live_headers(self) -> tuple[RingHeader, ...]:
        """The headers of the live rings (engine, instance, runner, shape), by engine."""
        with self._lock:
            if not self._probed(refresh=True):
                return ()
            return tuple(
                sorted(
                    (reader.header for reader in self._live),
                    key=lambda header: (header.instance, header.engine),
                )
            )

    def refusal(self) -> str | None:
        """Why the directory itself is refused (nothing in it is read), or ``None``."""
        with self._lock:
            if not self._probed():
                return None
            return self._refusal

    def failed_engines(self) -> tuple[EngineFailure, ...]:
        """Engines that hold a live failure note and no live ring (their hook did not start)."""
        with self._lock:
            if not self._probed(refresh=True):
                return ()
            return self._failures

    def publishing_instances(self) -> frozenset[int]:
        """The vLLM instances with at least one live ring."""
        with self._lock:
            if not self._probed():
                return frozenset()
            return frozenset(reader.header.instance for reader in self._live)

    def publish_marks(self) -> PublishMarks:
        """The live rings' publish counters now: pass to :meth:`overwritten_since` later."""
        with self._lock:
            if not self._probed():
                return {}
            marks: dict[tuple[int, int], int] = {}
            for reader in self._live:
                try:
                    marks[reader.identity] = reader.publish_count()
                except RingFormatError as exc:
                    self._drop_broken(reader.path.name, reader, exc)
            return marks

    def overwritten_since(self, marks: PublishMarks) -> bool:
        """True if some live ring published at least its slot count since ``marks``: a record
        published there after the marks may already have been overwritten (FIFO reuse), so
        waiting longer for it cannot help. A ring that started since counts from 0."""
        with self._lock:
            if not self._probed():
                return False
            for reader in self._live:
                try:
                    count = reader.publish_count()
                except RingFormatError:
                    continue
                if count - marks.get(reader.identity, 0) >= reader.slot_count:
                    return True
            return False

    def smallest_slot_count(self) -> int | None:
        """The smallest slot count of the live rings (for messages); ``None`` if none is live."""
        with self._lock:
            self._probe()
            return min((reader.slot_count for reader in self._live), default=None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            self._forget_liveness()
