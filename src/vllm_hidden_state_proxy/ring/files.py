"""File-level rules shared by ring files and failure notes: names, trust, locks, liveness.

**Names.** ``ring-<instance>-dp<engine>.bin`` for a ring, ``ring-<instance>-dp<engine>.failed``
for a failure note (an engine whose hook could not start its ring), where ``<instance>`` is 16
hex digits shared by the engines of one vLLM server and ``<engine>`` is vLLM's
``data_parallel_index``. So every engine of every server has its own names, and several
servers can share one directory.

**Trust.** A reader opens a file only if it is a regular file (no symlink), not writable by
group or others, and owned by a trusted user (by default the reader's own and root).

**Liveness.** A writer holds an exclusive ``flock`` on its file for its lifetime. It takes the
lock on the temporary file, before the file gets its name, and the kernel drops it when the
writer closes or its process exits in any way (SIGKILL included). A reader probes with a
non-blocking *shared* ``flock`` on its own descriptor (``flock`` works on read-only
descriptors, between processes, and between containers sharing the tmpfs): refused means a
writer lives; granted means none does, and the reader releases it at once.

**Sweeping.** A new writer removes the files of writers that are gone (no lock holder) from its
directory, so restarts do not fill the tmpfs. Readers that still map such a file keep a valid
mapping; they drop it when they notice it is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import stat
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Protocol

PREFIX = "ring-"
RING_SUFFIX = ".bin"
NOTE_SUFFIX = ".failed"
_NAME_RE = re.compile(r"ring-([0-9a-f]{16})-dp([0-9]{1,9})\.(bin|failed)")
_TEMP_PREFIX = ".ring-"

#: Who may own a file a reader accepts: one uid, several, or ``None`` (anyone).
Owners = int | Collection[int] | None

#: Seconds a new writer keeps trying to lock an existing file before concluding that a live
#: writer holds it (a reader's liveness probe holds a shared lock for microseconds).
IN_USE_WAIT = 0.2
_IN_USE_POLL = 0.005
#: Seconds before an unlocked temporary file counts as left behind by a crashed writer.
TEMP_GRACE = 60.0


def ring_name(instance: int, engine: int) -> str:
    return f"{PREFIX}{instance:016x}-dp{engine}{RING_SUFFIX}"


def note_name(instance: int, engine: int) -> str:
    return f"{PREFIX}{instance:016x}-dp{engine}{NOTE_SUFFIX}"


def parse_name(name: str) -> tuple[int, int, str] | None:
    """(instance, engine, suffix) of a ring or note file name, else ``None``."""
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return None
    return int(match[1], 16), int(match[2]), "." + match[3]


def files_named(directory: Path, suffix: str) -> list[tuple[Path, int]]:
    """(path, instance) of each ring (``RING_SUFFIX``) or note (``NOTE_SUFFIX``) file in
    ``directory``, by name; none if the directory cannot be listed."""
    try:
        with os.scandir(directory) as entries:
            names = sorted(entry.name for entry in entries)
    except OSError:
        return []
    found = []
    for name in names:
        parsed = parse_name(name)
        if parsed is not None and parsed[2] == suffix:
            found.append((directory / name, parsed[0]))
    return found


def owners(expected: Owners) -> frozenset[int] | None:
    if expected is None:
        return None
    return frozenset((expected,)) if isinstance(expected, int) else frozenset(expected)


class Untrusted(Exception):
    """A file a reader must not use (the message says why)."""


def open_trusted(path: Path, owner_uids: Owners) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its status, if the trust rules allow it.

    Raises :class:`Untrusted` (the descriptor is closed) otherwise.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Untrusted(f"cannot open: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("not a regular file")
        if st.st_mode & 0o022:
            raise Untrusted(
                f"mode {stat.S_IMODE(st.st_mode):#o} is writable by group/others; refusing"
            )
        trusted = owners(owner_uids)
        if trusted is not None and st.st_uid not in trusted:
            expected = " or ".join(str(uid) for uid in sorted(trusted))
            raise Untrusted(f"owned by uid {st.st_uid}, expected uid {expected}; refusing")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def flock_nb(fd: int, operation: int) -> bool:
    """Non-blocking ``flock``: True if granted, False if another open file holds a conflict."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def flock_retrying(fd: int, operation: int, seconds: float) -> bool:
    """:func:`flock_nb`, retried for ``seconds`` (readers' probes hold brief shared locks)."""
    deadline = time.monotonic() + seconds
    while not flock_nb(fd, operation):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_IN_USE_POLL)
    return True


def writer_alive(fd: int) -> bool:
    """Whether another open file holds an exclusive lock on this file (its writer lives).

    A probe error (no locking on this file system) counts as alive: nothing can then be told
    apart, and refusing every ring would be worse.
    """
    try:
        granted = flock_nb(fd, fcntl.LOCK_SH)
    except OSError:
        return True
    if not granted:
        return True
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def create_directory(directory: Path, mode: int) -> None:
    try:
        os.makedirs(directory, mode=mode)
    except FileExistsError:
        pass
    else:
        os.chmod(directory, mode)  # makedirs' mode is filtered through the umask


@contextlib.contextmanager
def directory_locked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` itself while the block runs: the hooks of vLLM
    servers that share a directory look at each other's rings and add their own one at a time.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def new_locked_temp(directory: Path, label: str, mode: int) -> tuple[int, str]:
    """A fresh temporary file in ``directory``, exclusively locked, with ``mode``."""
    fd = -1
    name = ""
    try:
        fd, name = _mkstemp(directory, label)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else has it
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot lock a new file in {directory}: {exc.strerror}"
            ) from exc
        os.fchmod(fd, mode)
    except BaseException:
        if fd >= 0:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name)
        raise
    return fd, name


def _mkstemp(directory: Path, label: str) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{label}.", suffix=".tmp", dir=directory)


class InUse(Exception):
    """A live writer holds the file at the name a new writer was to take."""


def install(tmp_name: str, final: Path, attempts: int = 100) -> None:
    """Give the ready, locked temp file the name ``final`` unless a live writer holds that name.

    A free name is taken with ``link()`` (fails if another writer took it first); an existing
    file is replaced only while we hold an exclusive ``flock`` on it and the name still refers
    to it, so two writers starting together never both succeed. Raises :class:`InUse`.
    """
    for _ in range(attempts):
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
            if not flock_retrying(old, fcntl.LOCK_EX, IN_USE_WAIT):
                raise InUse(f"{final} is held by a live writer")
            try:
                now = os.stat(final, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.replace(tmp_name, final)  # still under our lock: nobody else replaces it
                return
        finally:
            os.close(old)  # releases our lock on the old file
    raise InUse(f"{final} kept being replaced while this writer was starting")


def sweep_dead(directory: Path, keep: Collection[str] = ()) -> list[str]:
    """Remove ring files, failure notes and temporary files whose writer is gone.

    Each is removed only while this process holds an exclusive lock on it and the name still
    refers to it, so a live writer's file is never touched. Returns the removed names.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if name in keep or not (name.startswith(PREFIX) or name.startswith(_TEMP_PREFIX)):
            continue
        with contextlib.suppress(OSError):
            if _remove_if_dead(Path(entry.path), temporary=name.startswith(_TEMP_PREFIX)):
                removed.append(name)
    return removed


def _remove_if_dead(path: Path, *, temporary: bool) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        # A temporary file is unlocked for the instant between its creation and its writer's
        # flock: leave young ones alone.
        if temporary and time.time() - st.st_mtime < TEMP_GRACE:
            return False
        if not flock_nb(fd, fcntl.LOCK_EX):
            return False
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


class ForkForgetting(Protocol):
    def forget_after_fork(self) -> None: ...


def forget_in_forked_children(owner: ForkForgetting) -> None:
    """Make forked children drop ``owner``'s descriptors (without unlocking: the parent's lock
    is shared), so that only the writing process keeps a file alive. vLLM forks compile workers
    and other helpers, which would otherwise inherit the lock and outlive the writer."""
    ref: weakref.ReferenceType[ForkForgetting] = weakref.ref(owner)
    os.register_at_fork(after_in_child=functools.partial(_forget, ref))


def _forget(ref: Callable[[], ForkForgetting | None]) -> None:
    owner = ref()
    if owner is not None:
        owner.forget_after_fork()
