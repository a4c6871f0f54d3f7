"""Every ring and note of a directory, as the proxy sees it (ring/directory.py).

Rescans and liveness answers are rate-limited in production (``CHECK_INTERVAL``,
``LIVENESS_INTERVAL``); tests that follow changes set both to 0 on their directory instead of
sleeping, and the caching test sets them to an hour.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ring.helpers import (
    HIDDEN,
    LOGGER,
    assert_is_record_of,
    key_for,
    make_writer,
    publish_index,
    python_script,
    read_line,
    valid_ring_bytes,
    write_file,
)
from vllm_hidden_state_proxy.ring import (
    EngineFailure,
    ErrorRecord,
    FailureNote,
    RingDirectory,
    RingDirectoryConflict,
    RingReader,
    RingWriter,
    check_shareable,
)
from vllm_hidden_state_proxy.ring.files import note_name, ring_name


def following(directory: Path, **options: object) -> RingDirectory:
    """A directory that notices every change at once (no rate limits)."""
    rings = RingDirectory(directory, **options)  # type: ignore[arg-type]
    rings.CHECK_INTERVAL = 0.0
    rings.LIVENESS_INTERVAL = 0.0
    rings.refresh()  # the constructor's scan set the next check by the class's interval
    return rings


@pytest.fixture
def writers() -> Iterator[list[RingWriter]]:
    """Writers a test starts; all closed afterwards."""
    started: list[RingWriter] = []
    yield started
    for writer in started:
        writer.close()


# ---------------------------------------------------------------------------------------------
# several engines and several vLLM instances in one directory
# ---------------------------------------------------------------------------------------------


def test_two_engines_of_two_instances_get_distinct_rings_and_all_are_found(
    tmp_path: Path, writers: list[RingWriter]
) -> None:
    for instance in (0xAAAA, 0xBBBB):
        for engine in (0, 1):
            writers.append(make_writer(tmp_path, instance=instance, engine=engine))
    assert len({writer.path for writer in writers}) == 4
    assert sorted(os.listdir(tmp_path)) == sorted(
        ring_name(i, e) for i in (0xAAAA, 0xBBBB) for e in (0, 1)
    )
    for number, writer in enumerate(writers):
        publish_index(writer, number)
    with RingDirectory(tmp_path) as rings:
        assert rings.has_ring()
        assert rings.live_ring_count() == 4
        assert rings.publishing_instances() == frozenset({0xAAAA, 0xBBBB})
        assert rings.failed_engines() == ()
        for number in range(4):
            assert_is_record_of(rings.lookup(key_for(number)), number)
        assert rings.lookup(key_for(4)) is None


def test_servers_of_one_model_may_share_a_directory_servers_of_two_may_not(
    tmp_path: Path, writers: list[RingWriter]
) -> None:
    writers.append(make_writer(tmp_path, instance=0xAAAA, num_hidden_layers=2, layers=(0, 2)))
    # Another server of the same model (other layers captured: the proxy offers the common
    # ones), and more engines of the first server itself, whatever their shape.
    check_shareable(tmp_path, instance=0xBBBB, hidden_size=HIDDEN, num_hidden_layers=2)
    check_shareable(tmp_path, instance=0xAAAA, hidden_size=HIDDEN * 2, num_hidden_layers=5)
    for size, layers in ((HIDDEN * 2, 2), (HIDDEN, 3)):
        with pytest.raises(RingDirectoryConflict) as caught:
            check_shareable(tmp_path, instance=0xBBBB, hidden_size=size, num_hidden_layers=layers)
        message = str(caught.value)
        assert f"shared with another vLLM server (instance {0xAAAA:016x})" in message
        assert f"hidden size {HIDDEN} and 2 layers, where this one's has {size} and {layers}" in (
            message
        )
        assert "its own ring directory (HIDDEN_STATE_PROXY_RING_DIR; serve --ring-dir)" in message
    writers.pop().close()  # a gone writer's ring is no conflict
    check_shareable(tmp_path, instance=0xBBBB, hidden_size=HIDDEN * 2, num_hidden_layers=2)


def test_the_check_is_quiet(
    tmp_path: Path, writers: list[RingWriter], caplog: pytest.LogCaptureFixture
) -> None:
    """It runs in vLLM's engine: no line about the directory's rings and notes in its log (a
    DP test counts the proxy's 'no ring for engine' lines)."""
    writers.append(make_writer(tmp_path, instance=0xAAAA))
    note = FailureNote.write(tmp_path, instance=0xAAAA, engine=1, message="no space")
    try:
        with caplog.at_level(logging.DEBUG):
            check_shareable(tmp_path, instance=0xBBBB, hidden_size=HIDDEN, num_hidden_layers=1)
    finally:
        note.close()
    assert caplog.records == []


def test_eight_rings_a_key_is_found_in_whichever_holds_it(
    tmp_path: Path, writers: list[RingWriter]
) -> None:
    """Records land on any engine; lookups go on while all of them publish and wrap around."""
    writers.extend(make_writer(tmp_path, instance=7, engine=e, slot_count=4) for e in range(8))
    rings = following(tmp_path)
    newest: list[list[int]] = [[] for _ in writers]
    with rings:
        for number in range(200):
            engine = (number * 5) % 8
            publish_index(writers[engine], number)
            newest[engine] = [*newest[engine], number][-4:]
            if number % 3 == 0:  # lookups between publishes, at an uneven pace
                for engine_numbers in newest:
                    for kept in engine_numbers:
                        assert_is_record_of(rings.lookup(key_for(kept)), kept)
        kept_numbers = {n for engine_numbers in newest for n in engine_numbers}
        for number in range(200):
            found = rings.lookup(key_for(number))
            if number in kept_numbers:
                assert_is_record_of(found, number)
            else:
                assert found is None  # overwritten: gone, and never another key's record
        assert rings.live_ring_count() == 8
        assert len(rings.publish_marks()) == 8


def test_shapes_of_the_live_rings(tmp_path: Path, writers: list[RingWriter]) -> None:
    writers.append(make_writer(tmp_path, engine=0, slot_count=4, num_hidden_layers=6))
    writers.append(
        make_writer(tmp_path, engine=1, slot_count=8, num_hidden_layers=6, layers=(2, 6))
    )
    with following(tmp_path) as rings:
        shapes = sorted(rings.live_shapes(), key=lambda shape: shape.slot_count)
        assert [(s.slot_count, s.layers, s.hidden_size) for s in shapes] == [
            (4, (6,), HIDDEN),
            (8, (2, 6), HIDDEN),
        ]
        assert rings.smallest_slot_count() == 4
        writers[0].close()
        assert rings.smallest_slot_count() == 8
        assert [s.slot_count for s in rings.live_shapes()] == [8]


# ---------------------------------------------------------------------------------------------
# engines that start, restart and stop
# ---------------------------------------------------------------------------------------------


def test_a_restarted_writer_is_followed(tmp_path: Path) -> None:
    first = make_writer(tmp_path)
    k1 = publish_index(first, 1)
    explicit = RingDirectory(tmp_path)
    periodic = following(tmp_path)
    assert_is_record_of(explicit.lookup(k1), 1)
    assert_is_record_of(periodic.lookup(k1), 1)
    first.close()  # vLLM exited ...
    second = make_writer(tmp_path)  # ... and restarted: same name, new file
    k2 = publish_index(second, 2)
    explicit.refresh()
    assert explicit.lookup(k1) is None  # the old file's records went with it
    assert_is_record_of(explicit.lookup(k2), 2)
    assert periodic.lookup(k1) is None  # noticed by the lookup's own check
    assert_is_record_of(periodic.lookup(k2), 2)
    for closing in (explicit, periodic, second):
        closing.close()


def test_a_new_ring_is_picked_up(tmp_path: Path, writers: list[RingWriter]) -> None:
    directory = tmp_path / "not-yet"
    rings = RingDirectory(directory)  # the directory does not exist yet
    rings.CHECK_INTERVAL = 0.0
    assert not rings.has_ring()
    writers.append(make_writer(directory, engine=1))
    k1 = publish_index(writers[0], 3)
    assert rings.has_ring()  # it had none: it rescans at once
    assert_is_record_of(rings.lookup(k1), 3)
    writers.append(make_writer(directory, engine=2))
    k2 = publish_index(writers[1], 4)
    assert_is_record_of(rings.lookup(k2), 4)  # a miss rescans (once the check is due)
    assert rings.live_ring_count() == 2
    rings.close()
    assert rings.lookup(k1) is None


def test_a_dead_writers_ring_is_readable_but_not_live(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    writer = make_writer(tmp_path)
    key = publish_index(writer, 0)
    rings = following(tmp_path)
    assert rings.has_ring()
    writer.close()  # e.g. vLLM stopped; a restarted container keeps the memory volume
    for _ in range(3):
        assert not rings.has_ring()
        assert rings.live_ring_count() == 0
    assert_is_record_of(rings.lookup(key), 0)  # mapped and searchable ...
    assert rings.publish_marks() == {}  # ... but not publishing
    assert rings.smallest_slot_count() is None
    assert rings.live_shapes() == ()
    assert rings.publishing_instances() == frozenset()
    gone = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and str(writer.path) in gone[0].getMessage()
    rings.close()


def test_a_copy_of_a_ring_is_searchable_but_not_live(tmp_path: Path) -> None:
    write_file(tmp_path / ring_name(1, 0), valid_ring_bytes(tmp_path / "src"))
    with RingDirectory(tmp_path) as rings:
        assert not rings.has_ring()
        assert_is_record_of(rings.lookup(key_for(2)), 2)


HOLDER = """
writer = make_writer(Path(sys.argv[1]), instance=5)
for i in range(3):
    publish_index(writer, i)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_writer_killed_by_sigkill_stops_counting_and_a_restart_takes_over(
    tmp_path: Path,
) -> None:
    rings = following(tmp_path)
    with python_script(HOLDER, str(tmp_path)) as process, rings:
        assert read_line(process) == "ready"
        assert rings.has_ring()
        assert rings.smallest_slot_count() == 4
        (mark,) = rings.publish_marks().values()
        assert mark == 3
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
        assert not rings.has_ring()
        assert rings.smallest_slot_count() is None
        for i in range(3):  # the dead writer's records are still exactly their own
            assert_is_record_of(rings.lookup(key_for(i)), i)
        with make_writer(tmp_path, instance=5) as restarted:  # takes the name over at once
            assert rings.has_ring()
            assert rings.lookup(key_for(0)) is None  # gone with the old file
            key = publish_index(restarted, 7)
            assert_is_record_of(rings.lookup(key), 7)
            assert list(rings.publish_marks().values()) == [1]


def test_liveness_answers_are_reused_until_their_time_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes = 0
    real_is_live = RingReader.is_live

    def counting_is_live(self: RingReader) -> bool:
        nonlocal probes
        probes += 1
        return real_is_live(self)

    monkeypatch.setattr(RingReader, "is_live", counting_is_live)
    with make_writer(tmp_path) as writer, RingDirectory(tmp_path) as rings:
        rings.LIVENESS_INTERVAL = 3600.0
        rings.CHECK_INTERVAL = 3600.0
        probes = 0
        for _ in range(1000):
            assert rings.has_ring()
            assert rings.live_ring_count() == 1
            assert rings.smallest_slot_count() == 4
        assert probes <= 1  # one probe, reused
        publish_index(writer, 0)
        assert list(rings.publish_marks().values()) == [1]  # counters are read live
        probes = 0
        rings.refresh()  # a rescan forgets the answer
        assert rings.has_ring()
        assert probes == 1


# ---------------------------------------------------------------------------------------------
# publish marks and overwritten records
# ---------------------------------------------------------------------------------------------


def test_overwritten_since_counts_per_ring(tmp_path: Path, writers: list[RingWriter]) -> None:
    writers.append(make_writer(tmp_path, engine=0, slot_count=4))
    writers.append(make_writer(tmp_path, engine=1, slot_count=8))
    small, large = writers
    with following(tmp_path) as rings:
        marks = rings.publish_marks()
        assert sorted(marks.values()) == [0, 0]
        for i in range(3):
            publish_index(small, i)
        for i in range(7):
            publish_index(large, 10 + i)
        assert not rings.overwritten_since(marks)  # each ring below its slot count
        publish_index(small, 3)
        assert rings.overwritten_since(marks)  # the small ring went all the way round
        later = rings.publish_marks()
        assert not rings.overwritten_since(later)
        for i in range(8):
            publish_index(large, 20 + i)
        assert rings.overwritten_since(later)


def test_a_ring_started_after_the_marks_counts_from_zero(tmp_path: Path) -> None:
    with following(tmp_path) as rings:
        marks = rings.publish_marks()
        assert marks == {}
        with make_writer(tmp_path, slot_count=2) as writer:
            assert rings.has_ring()  # (lookups and has_ring notice new rings)
            publish_index(writer, 0)
            assert not rings.overwritten_since(marks)
            publish_index(writer, 1)
            assert rings.overwritten_since(marks)


# ---------------------------------------------------------------------------------------------
# failure notes
# ---------------------------------------------------------------------------------------------

DYING_NOTE = """
note = FailureNote.write(sys.argv[1], instance=0xAB, engine=3, message="dead engine")
print("ready", flush=True)
sys.stdin.read()
"""


def test_failed_engines_are_the_live_notes_without_a_live_ring(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, writers: list[RingWriter]
) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    writers.append(make_writer(tmp_path, instance=0xAB, engine=0))
    note = FailureNote.write(tmp_path, instance=0xAB, engine=1, message="no space on /dev/shm")
    # An engine that has a live ring after all (its note is stale): not failed.
    stale = FailureNote.write(tmp_path, instance=0xAB, engine=0, message="old")
    other = FailureNote.write(tmp_path, instance=0xCD, engine=0, message="hook disabled")
    rings = following(tmp_path)
    with python_script(DYING_NOTE, str(tmp_path)) as process, rings:
        assert read_line(process) == "ready"
        failures = rings.failed_engines()
        assert [(f.instance, f.engine) for f in failures] == [(0xAB, 1), (0xAB, 3), (0xCD, 0)]
        assert failures[0] == EngineFailure(0xAB, 1, os.getpid(), "no space on /dev/shm")
        assert failures[1].pid == process.pid
        assert rings.publishing_instances() == frozenset({0xAB})
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 3 and all(m.startswith("no ring for engine") for m in logged)
        rings.failed_engines()
        assert len(caplog.records) == 3  # each failure is logged once
        assert process.stdin is not None
        process.stdin.close()  # engine 3's process exits: its note dies with it
        assert process.wait(timeout=30) == 0
        assert (tmp_path / note_name(0xAB, 3)).exists()
        assert [(f.instance, f.engine) for f in rings.failed_engines()] == [(0xAB, 1), (0xCD, 0)]
        note.close()  # removed by its owner
        other.close()
        assert rings.failed_engines() == ()
        stale.close()


def test_a_note_appearing_later_is_noticed(tmp_path: Path, writers: list[RingWriter]) -> None:
    writers.append(make_writer(tmp_path, instance=1, engine=0))
    with following(tmp_path) as rings:
        assert rings.failed_engines() == ()
        note = FailureNote.write(tmp_path, instance=1, engine=1, message="late")
        try:
            (failure,) = rings.failed_engines()
            assert failure.message == "late"
        finally:
            note.close()


# ---------------------------------------------------------------------------------------------
# files the directory refuses or ignores
# ---------------------------------------------------------------------------------------------


def corrupt_variants(directory: Path) -> dict[str, tuple[bytes, str]]:
    good = valid_ring_bytes(directory)

    def with_u32(offset: int, value: int) -> bytes:
        changed = bytearray(good)
        changed[offset : offset + 4] = value.to_bytes(4, "little")
        return bytes(changed)

    return {
        "wrong-magic": (b"NOTRING\x00" + good[8:], "bad magic"),
        "not-ready": (with_u32(8, 0), "not ready"),
        "old-layout": (with_u32(8, 1), "unsupported layout version 1"),
        "empty": (b"", "truncated header"),
        "truncated-body": (good[:-100], "bytes but the header describes"),
        "random": (os.urandom(len(good)), "bad magic"),
        "slot-count": (with_u32(20, 1 << 20), "header describes"),
        "layers": (with_u32(136, 5), "captured layers"),
        "runner": (good[:72] + b"\xff" + good[73:], "runner field"),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "wrong-magic",
        "not-ready",
        "old-layout",
        "empty",
        "truncated-body",
        "random",
        "slot-count",
        "layers",
    ],
)
def test_a_corrupt_file_is_refused_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, variant: str
) -> None:
    data, reason = corrupt_variants(tmp_path / "src")[variant]
    directory = tmp_path / "rings"
    good = make_writer(directory, engine=0)
    key = publish_index(good, 0)
    bad = directory / ring_name(0, 1)
    write_file(bad, data)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rings = following(directory)
    assert_is_record_of(rings.lookup(key), 0)
    assert rings.lookup(key_for(1)) is None  # a miss rescans: the refusal is not repeated
    assert rings.live_ring_count() == 1
    refusals = [r for r in caplog.records if r.name == LOGGER and bad.name in r.getMessage()]
    assert len(refusals) == 1
    assert reason in refusals[0].getMessage()
    assert refusals[0].levelno == logging.WARNING
    rings.refresh()
    assert len([r for r in caplog.records if bad.name in r.getMessage()]) == 1
    rings.close()
    good.close()


def test_temporary_foreign_and_special_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    write_file(tmp_path / ".ring-0000000000000000-dp0.abc.tmp", b"half made")
    write_file(tmp_path / "notes.txt", b"hello")
    write_file(tmp_path / "ring-dp0.bin", b"the old name")
    (tmp_path / ring_name(1, 0)).mkdir()
    os.mkfifo(tmp_path / ring_name(2, 0), 0o600)
    (tmp_path / ring_name(3, 0)).symlink_to(tmp_path / "notes.txt")
    with RingDirectory(tmp_path) as rings:
        assert not rings.has_ring()
        assert rings.lookup(key_for(0)) is None
        assert rings.failed_engines() == ()
    messages = [r.getMessage() for r in caplog.records]
    assert not any(".tmp" in m or "notes.txt" in m or "ring-dp0" in m for m in messages)
    assert any(ring_name(1, 0) in m and "regular file" in m for m in messages)
    assert any(ring_name(2, 0) in m and "regular file" in m for m in messages)
    assert any(ring_name(3, 0) in m and "cannot open" in m for m in messages)


def test_a_group_writable_ring_is_refused_until_fixed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with make_writer(tmp_path) as writer:
        key = publish_index(writer, 0)
        os.chmod(writer.path, 0o660)
        rings = RingDirectory(tmp_path)
        assert not rings.has_ring()
        assert rings.lookup(key) is None
        assert any("writable by group/others" in r.getMessage() for r in caplog.records)
        os.chmod(writer.path, 0o640)  # fixed in place: picked up on the next rescan
        rings.refresh()
        assert_is_record_of(rings.lookup(key), 0)
        rings.close()


def test_rings_of_an_untrusted_owner_are_refused(tmp_path: Path) -> None:
    with make_writer(tmp_path) as writer:
        key = publish_index(writer, 0)
        uid = writer.path.stat().st_uid
        with RingDirectory(tmp_path, owner_uids=uid + 1) as refusing:
            assert refusing.lookup(key) is None
            assert not refusing.has_ring()
        with RingDirectory(tmp_path, owner_uids=(uid, uid + 1)) as trusting:
            assert_is_record_of(trusting.lookup(key), 0)


def test_notes_of_an_untrusted_owner_are_ignored(tmp_path: Path) -> None:
    note = FailureNote.write(tmp_path, instance=1, engine=0, message="m")
    try:
        uid = note.path.stat().st_uid
        with following(tmp_path, owner_uids=uid + 1) as rings:
            assert rings.failed_engines() == ()
        with following(tmp_path, owner_uids=uid) as rings:
            assert len(rings.failed_engines()) == 1
    finally:
        note.close()


def test_a_ring_truncated_under_the_mapping_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with make_writer(tmp_path, slot_count=64) as writer:
        key = publish_index(writer, 0)
        rings = following(tmp_path)
        assert rings.lookup(key) is not None
        os.truncate(writer.path, 100)
        assert rings.lookup(key) is None  # no SIGBUS: the reader checks the size first
        assert rings.publish_marks() == {}
        assert any("truncated after mapping" in r.getMessage() for r in caplog.records)
        os.truncate(writer.path, 0)
        assert rings.lookup(key) is None
        rings.close()


def test_error_records_are_found_like_records(tmp_path: Path) -> None:
    with make_writer(tmp_path) as writer, following(tmp_path) as rings:
        writer.publish_error(key_for(1), "could not copy the hidden states")
        assert rings.lookup(key_for(1)) == ErrorRecord(
            key_for(1), "could not copy the hidden states"
        )


def test_a_closed_directory_answers_nothing(tmp_path: Path) -> None:
    with make_writer(tmp_path) as writer:
        key = publish_index(writer, 0)
        note = FailureNote.write(tmp_path, instance=9, engine=0, message="m")
        rings = RingDirectory(tmp_path)
        marks = rings.publish_marks()
        rings.close()
        rings.close()
        rings.refresh()
        assert rings.lookup(key) is None
        assert not rings.has_ring()
        assert rings.live_ring_count() == 0
        assert rings.live_shapes() == ()
        assert rings.failed_engines() == ()
        assert rings.publishing_instances() == frozenset()
        assert rings.publish_marks() == {}
        assert not rings.overwritten_since(marks)
        note.close()


def test_no_directory_or_a_file_in_its_place(tmp_path: Path) -> None:
    write_file(tmp_path / "file", b"x")
    for path in (tmp_path / "missing", tmp_path / "file"):
        with RingDirectory(path) as rings:
            assert not rings.has_ring()
            assert rings.lookup(key_for(0)) is None
            assert rings.failed_engines() == ()
            assert rings.smallest_slot_count() is None
