"""File-level rules shared by ring files and failure notes: names, trust, locks, liveness.

**Names.** ``ring-<instance>-dp<engine>.bin`` for a ring, ``ring-<instance>-dp<engine>.failed``
for a failure note (an engine whose hook could not start its ring), where ``<instance>`` is 16
hex digits shared by the engines of one vLLM server and ``<engine>`` is vLLM's
``data_parallel_index``. So every engine of every server has its own names, and several
servers can share one directory.

**Trust.** A reader opens a file only if it is a regular file (no symlink), not writable by
group or others, and owned by a trusted user (by default the reader's own and root).

The directory is checked too, by both sides (:func:`open_directory`), because whoever controls
it controls every name in it (and the hooks' directory lock): it must be a real directory (not
a symlink; checked on the opened descriptor, so nothing can swap it between check and use),
owned by a trusted user (the hook and ``serve``: their own uid or root; the proxy: its trusted
owners, root and its own uid), and writable by nobody else: never by others (a world-writable
directory, sticky or not, lets any local user plant, rename or lock names), by its group only
where the settings ask for it (the hook's ``HIDDEN_STATE_PROXY_RING_DIR_MODE`` with group
write, e.g. ``0770``; the proxy allows it: a shared group is a deployment's choice it cannot
tell from a mistake, and it checks each file's owner anyway). The hook *repairs* a directory it
owns itself that grants more (a disk-backed Kubernetes ``emptyDir`` is created ``0777``; a
memory-backed one ``1777``, sticky, which the chart's init container sets to ``2770``): it
removes the extra write permissions, and logs that; it never touches a sticky world-writable
directory (``/tmp``-like: shared by design, give the rings their own directory inside it).

**The directory lock.** The hooks of servers sharing a directory add their rings one at a
time under an exclusive ``flock`` on the directory itself (:func:`directory_locked`). Anyone who
can open the directory can take that lock, so it is taken with a deadline; on timeout the error
names the holder's pid where ``/proc/locks`` shows it.

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
import logging
import os
import re
import stat
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Protocol

from vllm_hidden_state_proxy.protocol import RING_DIR_MODE_ENV, RING_LOCK_TIMEOUT_ENV

PREFIX = "ring-"
RING_SUFFIX = ".bin"
NOTE_SUFFIX = ".failed"
_NAME_RE = re.compile(r"ring-([0-9a-f]{16})-dp([0-9]{1,9})\.(bin|failed)")
_TEMP_PREFIX = ".ring-"

logger = logging.getLogger("vllm_hidden_state_proxy.ring")

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


class UntrustedDirectory(Exception):
    """A ring directory this process must not use (the message says why and what to change)."""


class DirectoryLocked(Exception):
    """The directory lock stayed held past the deadline (the message names the holder)."""


def self_and_root() -> frozenset[int]:
    """This process's own user and root: who may own a ring directory the hook uses (and any
    directory it reads: they could change whatever it reads anyway)."""
    return frozenset((os.geteuid(), 0))


#: (directory, file) modes of a ring without ``HIDDEN_STATE_PROXY_RING_DIR_MODE``: this user's
#: alone.
PRIVATE_MODES = (0o700, 0o600)


def ring_modes(raw: str | None) -> tuple[int, int]:
    """(directory, file) modes for a ``HIDDEN_STATE_PROXY_RING_DIR_MODE`` value (``None`` or
    empty: :data:`PRIVATE_MODES`). Raises ``ValueError`` naming the variable if it is not an
    octal mode."""
    if not raw:
        return PRIVATE_MODES
    try:
        dir_mode = int(raw, 8) & 0o770
    except ValueError:
        raise ValueError(f"{RING_DIR_MODE_ENV}={raw!r} is not an octal mode such as 0750") from None
    # Never group-writable files: the proxy refuses them.
    file_mode = ((dir_mode & 0o660) | 0o600) & ~0o022
    return dir_mode, file_mode


def open_directory(
    directory: Path, *, owner_uids: Owners, dir_mode: int | None, repair: bool = False
) -> int:
    """A read-only descriptor of ``directory`` if it may hold rings (see *Trust* above).

    ``dir_mode``: the mode the hook's settings ask for, whose group-write bit allows a
    group-writable directory; ``None`` (the proxy) allows group write. ``repair``: remove write
    permissions beyond that from a directory this process owns (not a sticky world-writable
    one). Raises :class:`UntrustedDirectory` (nothing left open) otherwise, and
    ``FileNotFoundError`` if there is nothing at ``directory`` (yet).
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UntrustedDirectory(_unopenable(directory, exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):  # O_DIRECTORY makes this impossible; belt and braces
            raise UntrustedDirectory(f"the ring directory {directory} is not a directory")
        trusted = owners(owner_uids)
        if trusted is not None and st.st_uid not in trusted:
            expected = " or ".join(str(uid) for uid in sorted(trusted))
            raise UntrustedDirectory(
                f"the ring directory {directory} is owned by uid {st.st_uid}, not by a trusted "
                f"user (uid {expected}): its owner could replace the rings or hold their lock; "
                "use a directory of your own"
            )
        _check_writers(directory, fd, st, dir_mode, repair)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_directory(
    directory: Path, *, owner_uids: Owners, dir_mode: int | None, repair: bool = False
) -> None:
    """:func:`open_directory`, for its verdict only."""
    os.close(open_directory(directory, owner_uids=owner_uids, dir_mode=dir_mode, repair=repair))


def _unopenable(directory: Path, exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            link = stat.S_ISLNK(os.lstat(directory).st_mode)
        except OSError:
            link = False
        if link:
            return (
                f"the ring directory {directory} is a symbolic link: whoever can change it "
                "chooses where the rings go; give the real directory's path"
            )
        return f"the ring directory {directory} is not a directory"
    return f"cannot open the ring directory {directory}: {exc.strerror or exc}"


def _check_writers(
    directory: Path, fd: int, st: os.stat_result, dir_mode: int | None, repair: bool
) -> None:
    mode = stat.S_IMODE(st.st_mode)
    allowed = 0o200 | (0o020 if dir_mode is None else dir_mode & 0o020)
    extra = mode & 0o022 & ~allowed
    if not extra:
        return
    sticky = bool(mode & stat.S_ISVTX)
    if extra & 0o002 and sticky:
        raise UntrustedDirectory(
            f"the ring directory {directory} (mode {mode:#o}) is a shared /tmp-like directory "
            "(writable by every user, sticky): any local user could plant names or hold its "
            "lock; use a directory of its own inside it"
        )
    if repair and st.st_uid == os.geteuid():
        # Ours, so nobody else could have made it so: a volume created 0777 (Kubernetes'
        # emptyDir), a umask of 002. Taking the extra permission away closes it from now on;
        # what anyone put there before is checked file by file.
        os.fchmod(fd, mode & ~extra)
        logger.warning(
            "the ring directory %s was writable by %s (mode %#o); made it %#o",
            directory,
            "every user" if extra & 0o002 else "its group",
            mode,
            mode & ~extra,
        )
        return
    if extra & 0o002:
        raise UntrustedDirectory(
            f"the ring directory {directory} (mode {mode:#o}) is writable by every user: any "
            "local user could replace the rings or hold their lock; make it writable by its "
            "owner alone (chmod o-w)"
        )
    raise UntrustedDirectory(
        f"the ring directory {directory} (mode {mode:#o}) is writable by its group (gid "
        f"{st.st_gid}), which {RING_DIR_MODE_ENV} ({dir_mode or 0o700:#o}) does not ask for: set "
        f"{RING_DIR_MODE_ENV}=0770 to share it with that group, or chmod g-w"
    )


def create_directory(directory: Path, mode: int) -> None:
    """Make ``directory`` with ``mode`` if it is missing; either way, check it as the hook must
    (:func:`open_directory`, repairing one of its own). Raises :class:`UntrustedDirectory`."""
    try:
        os.makedirs(directory, mode=mode)
    except FileExistsError:
        pass
    else:
        os.chmod(directory, mode)  # makedirs' mode is filtered through the umask
    check_directory(directory, owner_uids=self_and_root(), dir_mode=mode, repair=True)


@contextlib.contextmanager
def directory_locked(directory: Path, *, dir_mode: int, timeout: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` itself while the block runs: the hooks of vLLM
    servers that share a directory look at each other's rings and add their own one at a time.

    The directory is checked again on the descriptor that is locked. Raises
    :class:`DirectoryLocked` if the lock is not granted within ``timeout`` seconds: any user
    who can open the directory can hold it, and this runs inside vLLM's startup.
    """
    fd = open_directory(directory, owner_uids=self_and_root(), dir_mode=dir_mode)
    try:
        if not _flock_until(fd, time.monotonic() + timeout):
            raise DirectoryLocked(
                f"the lock of the ring directory {directory} was held by {lock_holder(fd)} for "
                f"more than {timeout:g} s ({RING_LOCK_TIMEOUT_ENV}); another vLLM server's "
                "hook holds it only while it adds its ring"
            )
        yield
    finally:
        os.close(fd)  # drops the lock


def probe_directory_lock(directory: Path, fd: int, seconds: float) -> str | None:
    """Why the directory lock cannot be taken now (retried for ``seconds``: a hook holds it
    briefly while adding its ring), or ``None``; the lock is released at once if granted."""
    if _flock_until(fd, time.monotonic() + seconds):
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    return f"the lock of the ring directory {directory} is held by {lock_holder(fd)}"


def _flock_until(fd: int, deadline: float) -> bool:
    """An exclusive ``flock`` on ``fd``, polled (a blocking ``flock`` has no timeout)."""
    pause = 0.001
    while not flock_nb(fd, fcntl.LOCK_EX):
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.05)
    return True


def lock_holder(fd: int, locks: Path = Path("/proc/locks")) -> str:
    """Who holds a ``flock`` on ``fd``'s file, from ``/proc/locks`` (``"pid N"``, ``"pids M,
    N"``), or ``"another process"`` where that does not tell (no procfs, another PID
    namespace)."""
    try:
        st = os.fstat(fd)
        text = locks.read_text()
    except OSError:
        return "another process"
    # "1: FLOCK  ADVISORY  WRITE 4242 00:1a:123 0 EOF"; waiters' lines carry "->" after the id.
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        if fields[5] == device and fields[4].isdigit() and fields[4] != "0":
            pids.append(fields[4])
    if not pids:
        return "another process"
    return ("pid " if len(pids) == 1 else "pids ") + ",".join(sorted(set(pids), key=int))


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
