"""File rules shared by rings and failure notes (ring/files.py): names, trust, locks, install,
sweeping."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ring.helpers import write_file
from vllm_hidden_state_proxy.ring import files
from vllm_hidden_state_proxy.ring.files import (
    InUse,
    Untrusted,
    create_directory,
    flock_nb,
    install,
    new_locked_temp,
    note_name,
    open_trusted,
    owners,
    parse_name,
    ring_name,
    sweep_dead,
    writer_alive,
)

# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------


def test_names_carry_instance_and_engine() -> None:
    assert ring_name(0x0123456789ABCDEF, 3) == "ring-0123456789abcdef-dp3.bin"
    assert note_name(1, 12) == "ring-0000000000000001-dp12.failed"
    for instance, engine in ((0, 0), ((1 << 64) - 1, 7), (0xABC, 123456789)):
        assert parse_name(ring_name(instance, engine)) == (instance, engine, ".bin")
        assert parse_name(note_name(instance, engine)) == (instance, engine, ".failed")


@pytest.mark.parametrize(
    "name",
    [
        "ring-dp0.bin",  # the old, per-rank name
        "ring-0123456789ABCDEF-dp0.bin",  # upper-case hex
        "ring-0123456789abcde-dp0.bin",  # 15 digits
        "ring-0123456789abcdef-dp.bin",
        "ring-0123456789abcdef-dp1234567890.bin",  # 10 digits
        "ring-0123456789abcdef-dp0.bin.tmp",
        "ring-0123456789abcdef-dp0.txt",
        ".ring-0123456789abcdef-dp0.abc.tmp",
        " ring-0123456789abcdef-dp0.bin",
        "ring-0123456789abcdef-dp-1.bin",
    ],
)
def test_other_names_are_not_rings_or_notes(name: str) -> None:
    assert parse_name(name) is None


def test_owners() -> None:
    assert owners(None) is None
    assert owners(5) == frozenset({5})
    assert owners([0, 5, 5]) == frozenset({0, 5})


# ---------------------------------------------------------------------------------------------
# trust
# ---------------------------------------------------------------------------------------------


def test_a_private_regular_file_is_trusted(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_file(path, b"x", 0o640)
    fd, st = open_trusted(path, None)
    try:
        assert stat.S_ISREG(st.st_mode) and st.st_size == 1
        assert os.read(fd, 1) == b"x"
    finally:
        os.close(fd)
    fd, _ = open_trusted(path, [st.st_uid, 12345])
    os.close(fd)


@pytest.mark.parametrize(
    ("mode", "refused"), [(0o600, False), (0o644, False), (0o620, True), (0o602, True)]
)
def test_group_or_other_writable_files_are_refused(
    tmp_path: Path, mode: int, refused: bool
) -> None:
    path = tmp_path / "f"
    write_file(path, b"x", mode)
    if refused:
        with pytest.raises(Untrusted, match=f"mode {mode:#o} is writable by group/others"):
            open_trusted(path, None)
    else:
        os.close(open_trusted(path, None)[0])


def test_a_file_of_another_owner_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_file(path, b"x")
    uid = path.stat().st_uid
    with pytest.raises(Untrusted, match=f"owned by uid {uid}, expected uid {uid + 1} or {uid + 2}"):
        open_trusted(path, (uid + 2, uid + 1))


def test_symlinks_and_special_files_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    write_file(target, b"x")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(Untrusted, match="cannot open"):
        open_trusted(tmp_path / "link", None)
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(Untrusted, match="not a regular file"):
        open_trusted(tmp_path / "fifo", None)
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(Untrusted, match="not a regular file"):
        open_trusted(tmp_path / "dir", None)
    with pytest.raises(Untrusted, match="cannot open"):
        open_trusted(tmp_path / "missing", None)


def test_a_socket_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        with pytest.raises(Untrusted, match="cannot open"):  # ENXIO: sockets do not open
            open_trusted(tmp_path / "sock", None)


# ---------------------------------------------------------------------------------------------
# locks and liveness
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def locked_file(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A file and a descriptor of it holding an exclusive lock (a live writer)."""
    path = tmp_path / "f"
    write_file(path, b"x")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield path, fd
    finally:
        os.close(fd)


def test_writer_alive_while_another_open_file_holds_the_lock(
    locked_file: tuple[Path, int],
) -> None:
    path, holder = locked_file
    probe = os.open(path, os.O_RDONLY)
    try:
        assert writer_alive(probe)
        assert writer_alive(probe)
        os.close(holder)  # the writer is gone (exit closes its descriptors the same way)
        holder = os.open(path, os.O_RDONLY)  # keep the fixture's close() valid
        assert not writer_alive(probe)
        assert flock_nb(holder, fcntl.LOCK_EX)  # the probe let go of its shared lock
    finally:
        os.close(probe)


def test_a_probe_error_counts_as_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> bool:
        raise OSError(errno.ENOLCK, "no locks here")

    monkeypatch.setattr(files, "flock_nb", no_locks)
    path = tmp_path / "f"
    write_file(path, b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert writer_alive(fd)
    finally:
        os.close(fd)


def test_flock_retrying_gives_up_after_its_time(locked_file: tuple[Path, int]) -> None:
    path, _ = locked_file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not files.flock_retrying(fd, fcntl.LOCK_EX, 0.0)
    finally:
        os.close(fd)


def test_create_directory_applies_the_mode_despite_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        create_directory(tmp_path / "a" / "b", 0o750)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o750
    os.chmod(tmp_path / "a" / "b", 0o700)
    create_directory(tmp_path / "a" / "b", 0o750)  # an existing directory is left as it is
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


def test_new_locked_temp_is_private_locked_and_hidden(tmp_path: Path) -> None:
    fd, name = new_locked_temp(tmp_path, "ring-x", 0o640)
    try:
        assert Path(name).parent == tmp_path
        assert Path(name).name.startswith(".ring-ring-x.") and name.endswith(".tmp")
        assert parse_name(Path(name).name) is None
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o640
        other = os.open(name, os.O_RDONLY)
        try:
            assert writer_alive(other)
        finally:
            os.close(other)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# install: a ready temp file takes its final name unless a live writer holds it
# ---------------------------------------------------------------------------------------------


def ready_temp(directory: Path, content: bytes) -> tuple[int, str]:
    fd, name = new_locked_temp(directory, "t", 0o600)
    os.write(fd, content)
    return fd, name


def test_install_takes_a_free_name(tmp_path: Path) -> None:
    fd, tmp = ready_temp(tmp_path, b"new")
    try:
        install(tmp, tmp_path / "final")
        assert (tmp_path / "final").read_bytes() == b"new"
        assert os.listdir(tmp_path) == ["final"]
    finally:
        os.close(fd)


@pytest.mark.parametrize("existing", ["dead-file", "symlink", "fifo"])
def test_install_replaces_what_no_live_writer_holds(tmp_path: Path, existing: str) -> None:
    final = tmp_path / "final"
    if existing == "dead-file":
        write_file(final, b"old")
    elif existing == "symlink":
        final.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(final, 0o600)
    fd, tmp = ready_temp(tmp_path, b"new")
    try:
        install(tmp, final)
    finally:
        os.close(fd)
    assert not final.is_symlink() and final.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["final"]


def test_install_refuses_a_name_a_live_writer_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)
    final = tmp_path / "final"
    write_file(final, b"live")
    holder = os.open(final, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    fd, tmp = ready_temp(tmp_path, b"new")
    try:
        with pytest.raises(InUse, match="held by a live writer"):
            install(tmp, final)
    finally:
        os.close(fd)
        os.close(holder)
    assert final.read_bytes() == b"live"


def test_install_waits_out_a_readers_brief_shared_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's liveness probe holds a shared lock for an instant: the installer retries
    instead of mistaking it for a live writer. Here the probe ends right after the installer's
    first refused attempt."""
    final = tmp_path / "final"
    write_file(final, b"dead")
    probe = os.open(final, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    attempts: list[bool] = []
    real_flock_nb = files.flock_nb

    def flock_nb_ending_the_probe(fd: int, operation: int) -> bool:
        granted = real_flock_nb(fd, operation)
        if operation == fcntl.LOCK_EX:
            attempts.append(granted)
            fcntl.flock(probe, fcntl.LOCK_UN)
        return granted

    monkeypatch.setattr(files, "flock_nb", flock_nb_ending_the_probe)
    fd, tmp = ready_temp(tmp_path, b"new")
    try:
        install(tmp, final)
    finally:
        os.close(fd)
        os.close(probe)
    assert attempts == [False, True]
    assert final.read_bytes() == b"new"


def test_install_into_a_directory_name_fails(tmp_path: Path) -> None:
    (tmp_path / "final").mkdir()
    fd, tmp = ready_temp(tmp_path, b"new")
    try:
        with pytest.raises(OSError):
            install(tmp, tmp_path / "final")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# sweeping the files of writers that are gone
# ---------------------------------------------------------------------------------------------


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_sweep_removes_dead_files_only(tmp_path: Path) -> None:
    dead_ring, dead_note = tmp_path / ring_name(1, 0), tmp_path / note_name(1, 1)
    live_ring = tmp_path / ring_name(2, 0)
    young_temp = tmp_path / ".ring-x.abc.tmp"
    old_temp, old_locked_temp = tmp_path / ".ring-y.abc.tmp", tmp_path / ".ring-z.abc.tmp"
    foreign = tmp_path / "notes.txt"
    for path in (dead_ring, dead_note, live_ring, young_temp, old_temp, old_locked_temp, foreign):
        write_file(path, b"x")
    for path in (old_temp, old_locked_temp, foreign, dead_ring):
        age(path, files.TEMP_GRACE + 60)
    (tmp_path / ring_name(3, 0)).mkdir()  # not a regular file: left alone
    (tmp_path / ring_name(4, 0)).symlink_to(dead_ring)
    holders = [os.open(p, os.O_RDONLY) for p in (live_ring, old_locked_temp)]
    for holder in holders:
        fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        removed = sweep_dead(tmp_path)
    finally:
        for holder in holders:
            os.close(holder)
    assert sorted(removed) == sorted([dead_ring.name, dead_note.name, old_temp.name])
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            live_ring.name,
            young_temp.name,
            old_locked_temp.name,
            foreign.name,
            ring_name(3, 0),
            ring_name(4, 0),
        ]
    )


def test_sweep_keeps_what_it_is_told_to(tmp_path: Path) -> None:
    write_file(tmp_path / ring_name(1, 0), b"x")
    write_file(tmp_path / ring_name(1, 1), b"x")
    assert sweep_dead(tmp_path, keep=[ring_name(1, 0)]) == [ring_name(1, 1)]
    assert os.listdir(tmp_path) == [ring_name(1, 0)]


def test_sweep_of_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert sweep_dead(tmp_path / "missing") == []


def test_sweep_never_removes_a_file_a_writer_locks_while_it_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is removed only under the sweeper's own exclusive lock: a writer that holds
    the file at that moment keeps it."""
    path = tmp_path / ring_name(1, 0)
    write_file(path, b"x")
    real_flock_nb = files.flock_nb
    holder: list[int] = []

    def writer_takes_it_first(fd: int, operation: int) -> bool:
        if not holder:
            holder.append(os.open(path, os.O_RDONLY))
            fcntl.flock(holder[0], fcntl.LOCK_EX)
        return real_flock_nb(fd, operation)

    monkeypatch.setattr(files, "flock_nb", writer_takes_it_first)
    try:
        assert sweep_dead(tmp_path) == []
    finally:
        os.close(holder[0])
    assert path.exists()


def test_sweep_leaves_a_name_that_was_replaced_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / ring_name(1, 0)
    write_file(path, b"old")
    real_flock_nb = files.flock_nb

    def replaced_after_locking(fd: int, operation: int) -> bool:
        granted = real_flock_nb(fd, operation)
        write_file(path, b"new")  # a new writer installed its file under the name
        return granted

    monkeypatch.setattr(files, "flock_nb", replaced_after_locking)
    assert sweep_dead(tmp_path) == []
    assert path.read_bytes() == b"new"


# ---------------------------------------------------------------------------------------------
# two creators racing for one name (rings and notes use the same install)
# ---------------------------------------------------------------------------------------------


def race_to_install(directory: Path, racers: int) -> list[str]:
    """``racers`` threads install a ready temp file each at one name at once; their outcomes."""
    final = directory / "final"
    temps = [ready_temp(directory, str(i).encode()) for i in range(racers)]
    barrier = threading.Barrier(racers)
    outcomes: list[str] = []

    def race(tmp: str) -> None:
        barrier.wait()
        try:
            install(tmp, final)
            outcomes.append("won")
        except InUse:
            os.unlink(tmp)
            outcomes.append("lost")

    threads = [threading.Thread(target=race, args=(tmp,)) for _, tmp in temps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for fd, _ in temps:
        os.close(fd)
    return outcomes


def test_racing_installers_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)
    for round_ in range(10):
        directory = tmp_path / f"round{round_}"
        directory.mkdir()
        assert sorted(race_to_install(directory, 4)) == ["lost", "lost", "lost", "won"]
        assert os.listdir(directory) == ["final"]


def test_directory_locked_excludes_another_holder(tmp_path: Path) -> None:
    """Two hooks sharing a directory check and add their rings one at a time."""
    other = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with files.directory_locked(tmp_path, dir_mode=0o700, timeout=1.0):
            assert not files.flock_nb(other, fcntl.LOCK_EX)
        assert files.flock_nb(other, fcntl.LOCK_EX)  # released when the block ends
    finally:
        os.close(other)
