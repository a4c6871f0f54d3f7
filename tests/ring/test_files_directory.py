"""The ring directory's own checks (ring/files.py ``open_directory``) and its lock's deadline:
what both the hook and the proxy refuse, what the hook repairs, and who holds the lock."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ring.helpers import LOGGER, directory_lock_held
from vllm_hidden_state_proxy.ring import files
from vllm_hidden_state_proxy.ring.files import (
    DirectoryLocked,
    UntrustedDirectory,
    check_directory,
    create_directory,
    directory_locked,
    lock_holder,
    open_directory,
    probe_directory_lock,
    ring_modes,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _made(tmp_path: Path, mode: int, name: str = "rings") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    os.chmod(directory, mode)
    return directory


def _refusal(directory: Path, **kwargs: object) -> str:
    options: dict[str, object] = {"owner_uids": files.self_and_root(), "dir_mode": 0o700}
    options.update(kwargs)
    with pytest.raises(UntrustedDirectory) as caught:
        check_directory(directory, **options)  # type: ignore[arg-type]
    return str(caught.value)


def test_a_private_directory_of_ones_own_is_accepted(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o700)
    fd = open_directory(directory, owner_uids=files.self_and_root(), dir_mode=0o700)
    try:
        assert os.fstat(fd).st_ino == directory.stat().st_ino
    finally:
        os.close(fd)


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = _made(tmp_path, 0o700, "real")
    link = tmp_path / "rings"
    link.symlink_to(real)
    assert "is a symbolic link" in _refusal(link)
    assert "is a symbolic link" in _refusal(link, owner_uids=None, dir_mode=None)  # the proxy
    with pytest.raises(UntrustedDirectory, match="symbolic link"):
        create_directory(link, 0o700)


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "rings"
    path.write_bytes(b"")
    assert "is not a directory" in _refusal(path)


@needs_root
def test_a_directory_of_another_user_is_refused_by_both_sides(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o700)
    os.chown(directory, NOBODY, -1)
    message = _refusal(directory)
    assert f"owned by uid {NOBODY}" in message and "uid 0" in message
    assert f"owned by uid {NOBODY}" in _refusal(directory, owner_uids=(0,), dir_mode=None)
    with pytest.raises(UntrustedDirectory, match=f"uid {NOBODY}"):
        create_directory(directory, 0o700)  # the hook's path: never repaired, never used
    check_directory(directory, owner_uids=None, dir_mode=None)  # owners None: anyone


@pytest.mark.parametrize("mode", [0o777, 0o2777, 0o757])
def test_a_world_writable_directory_is_refused(tmp_path: Path, mode: int) -> None:
    directory = _made(tmp_path, mode)
    assert "writable by every user" in _refusal(directory)
    assert "writable by every user" in _refusal(directory, owner_uids=None, dir_mode=None)
    assert _mode(directory) == mode  # a check alone changes nothing


def test_a_sticky_shared_directory_is_refused_and_never_repaired(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o1777)
    assert "/tmp-like" in _refusal(directory, repair=True)
    with pytest.raises(UntrustedDirectory, match="/tmp-like"):
        create_directory(directory, 0o700)
    assert _mode(directory) == 0o1777


def test_the_hook_repairs_a_world_writable_directory_of_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Kubernetes emptyDir with fsGroup is drwxrwsrwx root:fsGroup: the hook (root) takes the
    write permissions its settings do not ask for away (only those), keeping the setgid group."""
    directory = _made(tmp_path, 0o2777)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        create_directory(directory, 0o770)
    assert _mode(directory) == 0o2775
    assert "writable by every user (mode 0o2777); made it 0o2775" in caplog.text
    create_directory(directory, 0o750)  # group write not asked for: taken away too
    assert _mode(directory) == 0o2755


def test_group_write_is_accepted_where_the_settings_ask_for_it(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o2770)  # compose's tmpfs: mode=2770,gid=10001
    check_directory(directory, owner_uids=files.self_and_root(), dir_mode=0o770)
    check_directory(directory, owner_uids=None, dir_mode=None)  # the proxy allows a group
    message = _refusal(directory, dir_mode=0o750)
    assert "writable by its group" in message
    assert "HIDDEN_STATE_PROXY_RING_DIR_MODE (0o750)" in message and "=0770" in message
    create_directory(directory, 0o770)
    assert _mode(directory) == 0o2770  # nothing to repair


@needs_root
def test_root_never_repairs_a_directory_it_does_not_own(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o777)
    os.chown(directory, NOBODY, -1)
    assert "writable by every user" in _refusal(directory, owner_uids=None, repair=True)
    assert _mode(directory) == 0o777


def test_ring_modes() -> None:
    assert ring_modes(None) == ring_modes("") == (0o700, 0o600)
    assert ring_modes("0750") == (0o750, 0o640)
    assert ring_modes("0770") == (0o770, 0o640)
    assert ring_modes("0777") == (0o770, 0o640)  # never world bits
    with pytest.raises(ValueError, match="HIDDEN_STATE_PROXY_RING_DIR_MODE='rw'"):
        ring_modes("rw")


# ---------------------------------------------------------------------------------------------
# the lock's deadline
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A ring directory whose lock another process holds: (directory, that process's pid)."""
    directory = _made(tmp_path, 0o700)
    with directory_lock_held(directory) as pid:
        yield directory, pid


def test_directory_locked_gives_up_at_its_deadline_naming_the_holder(
    held: tuple[Path, int],
) -> None:
    directory, pid = held
    started = time.monotonic()
    with (
        pytest.raises(DirectoryLocked) as caught,
        directory_locked(directory, dir_mode=0o700, timeout=0.3),
    ):
        pytest.fail("the lock was granted although another process holds it")
    assert 0.3 <= time.monotonic() - started < 5
    message = str(caught.value)
    assert str(directory) in message and "0.3 s" in message
    assert "HIDDEN_STATE_PROXY_RING_LOCK_TIMEOUT" in message
    if Path("/proc/locks").exists():
        assert f"held by pid {pid} " in message


def test_probe_directory_lock_is_bounded_and_releases_what_it_gets(
    held: tuple[Path, int], tmp_path: Path
) -> None:
    directory, _ = held
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        reason = probe_directory_lock(directory, fd, 0.1)
        assert reason is not None and str(directory) in reason
    finally:
        os.close(fd)
    free = _made(tmp_path, 0o700, "free")
    fd = os.open(free, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert probe_directory_lock(free, fd, 0.1) is None
        with directory_locked(free, dir_mode=0o700, timeout=0.1):  # released again
            pass
    finally:
        os.close(fd)


def test_lock_holder_reads_proc_locks(tmp_path: Path) -> None:
    directory = _made(tmp_path, 0o700)
    st = directory.stat()
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: POSIX  ADVISORY  WRITE 11 {device} 0 EOF\n"  # not a flock
        f"2: FLOCK  ADVISORY  WRITE 4242 {device} 0 EOF\n"
        f"2: -> FLOCK  ADVISORY  WRITE 4343 {device} 0 EOF\n"  # a waiter, not the holder
        f"3: FLOCK  ADVISORY  WRITE 99 {device}0 0 EOF\n"  # another inode
    )
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert lock_holder(fd, locks) == "pid 4242"
        locks.write_text(f"2: FLOCK  ADVISORY  WRITE 0 {device} 0 EOF\n")  # another namespace
        assert lock_holder(fd, locks) == "another process"
        assert lock_holder(fd, tmp_path / "missing") == "another process"
    finally:
        os.close(fd)
