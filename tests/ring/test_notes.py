"""Failure notes (ring/notes.py): an engine whose hook could not start says so while it lives."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.ring.helpers import python_script, read_line, write_file
from vllm_hidden_state_proxy.ring import EngineFailure, FailureNote, files
from vllm_hidden_state_proxy.ring.notes import MAX_NOTE_BYTES, live_notes, read_live_note

INSTANCE = 0x00C0FFEE00C0FFEE


def test_a_note_names_its_engine_and_is_live_while_its_writer_is(tmp_path: Path) -> None:
    note = FailureNote.write(tmp_path / "rings", instance=INSTANCE, engine=3, message="no space")
    assert note.path == tmp_path / "rings" / "ring-00c0ffee00c0ffee-dp3.failed"
    assert stat.S_IMODE(note.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "rings").stat().st_mode) == 0o700
    assert json.loads(note.path.read_bytes()) == {
        "instance": INSTANCE,
        "engine": 3,
        "pid": os.getpid(),
        "message": "no space",
        "refused_settings": False,
        "fatal": False,
    }
    failure = read_live_note(note.path, None)
    assert failure == EngineFailure(INSTANCE, 3, os.getpid(), "no space")
    described = failure.describe()
    for part in (
        "engine 3",
        "00c0ffee00c0ffee",
        f"pid {os.getpid()}",
        "could not start",
        "no space",
    ):
        assert part in described
    note.close()
    note.close()  # idempotent
    assert not note.path.exists()
    assert os.listdir(tmp_path / "rings") == []


def test_a_note_says_whether_the_hook_refused_the_servers_settings(tmp_path: Path) -> None:
    note = FailureNote.write(
        tmp_path, instance=1, engine=0, message="LayerConfigError: m", refused_settings=True
    )
    try:
        failure = read_live_note(note.path, None)
        assert failure == EngineFailure(1, 0, os.getpid(), "LayerConfigError: m", True)
    finally:
        note.close()


@pytest.mark.parametrize(("written", "read"), [({}, False), ({"refused_settings": 1}, None)])
def test_a_note_without_the_flag_is_not_a_refusal_and_a_malformed_flag_no_note(
    tmp_path: Path, written: dict[str, object], read: bool | None
) -> None:
    """Notes of hooks that predate the flag read as "not refused"; a flag that is not a boolean
    makes the note malformed (ignored, like any other)."""
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="m")
    try:
        document = {"instance": 1, "engine": 0, "pid": os.getpid(), "message": "m", **written}
        os.truncate(note.path, 0)
        note.path.write_bytes(json.dumps(document).encode())
        failure = read_live_note(note.path, None)
        assert (failure if failure is None else failure.refused_settings) == read
    finally:
        note.close()


@pytest.mark.parametrize(
    ("written", "fatal"),
    [
        ({}, False),  # a hook that predates both flags
        ({"refused_settings": True}, True),  # one that predates "fatal": a refusal is fatal
        ({"refused_settings": False, "fatal": True}, True),  # an incompatible vLLM, say
        ({"refused_settings": False, "fatal": False}, False),
        ({"fatal": "yes"}, None),  # malformed: no note
    ],
)
def test_a_note_says_whether_it_is_fatal(
    tmp_path: Path, written: dict[str, object], fatal: bool | None
) -> None:
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="m")
    try:
        document = {"instance": 1, "engine": 0, "pid": os.getpid(), "message": "m", **written}
        os.truncate(note.path, 0)
        note.path.write_bytes(json.dumps(document).encode())
        failure = read_live_note(note.path, None)
        assert (failure if failure is None else failure.fatal) == fatal
    finally:
        note.close()


def test_the_writer_marks_refusals_fatal_and_fatal_notes_as_asked(tmp_path: Path) -> None:
    for refused, fatal, expected in (
        (True, False, True),
        (False, True, True),
        (False, False, False),
    ):
        note = FailureNote.write(
            tmp_path, instance=1, engine=0, message="m", refused_settings=refused, fatal=fatal
        )
        try:
            failure = read_live_note(note.path, None)
            assert failure is not None and failure.fatal is expected
            assert failure.refused_settings is refused
        finally:
            note.close()


def test_live_notes_lists_the_live_ones_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = FailureNote.write(tmp_path, instance=2, engine=1, message="b")
    second = FailureNote.write(tmp_path, instance=1, engine=0, message="a", refused_settings=True)
    gone = FailureNote.write(tmp_path, instance=3, engine=0, message="gone")
    gone.forget_after_fork()  # its lock released, the file left: a dead engine's note
    (tmp_path / "ring-0000000000000001-dp0.bin").write_bytes(b"not a note")
    try:
        with caplog.at_level(logging.DEBUG):
            notes = live_notes(tmp_path)
    finally:
        first.close()
        second.close()
    assert [(n.instance, n.engine, n.refused_settings) for n in notes] == [
        (1, 0, True),
        (2, 1, False),
    ]
    assert caplog.records == []
    assert live_notes(tmp_path / "missing") == []


def test_a_long_message_is_cut(tmp_path: Path) -> None:
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="x" * 10_000)
    try:
        failure = read_live_note(note.path, None)
        assert failure is not None and failure.message == "x" * 4000
    finally:
        note.close()


def test_notes_are_read_only_from_trusted_owners(tmp_path: Path) -> None:
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="m")
    try:
        uid = note.path.stat().st_uid
        assert read_live_note(note.path, uid) is not None
        assert read_live_note(note.path, uid + 1) is None
        os.chmod(note.path, 0o620)
        assert read_live_note(note.path, None) is None
    finally:
        note.close()


def test_a_second_note_for_a_live_engine_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="first")
    try:
        with pytest.raises(files.InUse):
            FailureNote.write(tmp_path, instance=1, engine=0, message="second")
        assert os.listdir(tmp_path) == [note.path.name]
        failure = read_live_note(note.path, None)
        assert failure is not None and failure.message == "first"
    finally:
        note.close()


NOTE_WRITER = """
note = FailureNote.write(sys.argv[1], instance=7, engine=int(sys.argv[2]), message="boom")
if sys.argv[3] == "fork":
    if os.fork() == 0:  # the child: its after-fork hooks have run when fork returns here
        print(os.getpid(), flush=True)
        sys.stdin.read()
        os._exit(0)
else:
    print(os.getpid(), flush=True)
sys.stdin.read()  # lives until the test closes stdin or kills it
"""


def test_a_note_dies_with_its_process(tmp_path: Path) -> None:
    with python_script(NOTE_WRITER, str(tmp_path), "1", "plain") as process:
        pid = int(read_line(process))
        path = tmp_path / "ring-0000000000000007-dp1.failed"
        assert read_live_note(path, None) == EngineFailure(7, 1, pid, "boom")
        assert process.stdin is not None
        process.stdin.close()  # the engine process exits (without closing the note)
        assert process.wait(timeout=30) == 0
        assert path.exists()
        assert read_live_note(path, None) is None


def test_a_forked_child_does_not_keep_a_note_alive(tmp_path: Path) -> None:
    with python_script(NOTE_WRITER, str(tmp_path), "2", "fork") as process:
        child = int(read_line(process))
        try:
            path = tmp_path / "ring-0000000000000007-dp2.failed"
            assert read_live_note(path, None) is not None
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
            os.kill(child, 0)  # still running
            assert read_live_note(path, None) is None
        finally:
            os.kill(child, signal.SIGKILL)


@contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold ``path``'s liveness lock, as a living engine process would."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


GOOD = {"instance": 1, "engine": 2, "pid": 3, "message": "m"}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({**GOOD, "engine": "2"}).encode(),
        json.dumps({**GOOD, "pid": True}).encode(),
        json.dumps({**GOOD, "message": None}).encode(),
        json.dumps({k: v for k, v in GOOD.items() if k != "instance"}).encode(),
        json.dumps({**GOOD, "message": "x" * MAX_NOTE_BYTES}).encode(),
    ],
    ids=[
        "empty",
        "not-json",
        "not-utf8",
        "not-an-object",
        "engine-str",
        "pid-bool",
        "message-null",
        "no-instance",
        "too-large",
    ],
)
def test_malformed_live_notes_are_ignored(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "ring-0000000000000001-dp2.failed"
    write_file(path, json.dumps(GOOD).encode())
    with held(path):
        assert read_live_note(path, None) == EngineFailure(1, 2, 3, "m")
    write_file(path, content)
    with held(path):
        assert read_live_note(path, None) is None


def test_special_files_are_not_notes(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo", 0o600)
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    for name in ("fifo", "link", "missing"):
        assert read_live_note(tmp_path / name, None) is None
