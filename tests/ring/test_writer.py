"""The worker hook's side (ring/writer.py): creating a ring, publishing, one live writer per name,
sweeping what dead writers left, fork safety."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import threading
from pathlib import Path

import pytest

from tests.ring.helpers import (
    HIDDEN,
    MODEL,
    assert_is_record_of,
    key_for,
    make_writer,
    publish_index,
    python_script,
    read_line,
    wait_until,
    write_file,
)
from vllm_hidden_state_proxy.protocol import RING_DIR_ENV
from vllm_hidden_state_proxy.ring import (
    ErrorRecord,
    RingInUseError,
    RingReader,
    RingWriter,
    files,
)
from vllm_hidden_state_proxy.ring.layout import MAX_SLOT_COUNT, slot_size_for

# ---------------------------------------------------------------------------------------------
# creating
# ---------------------------------------------------------------------------------------------


def test_create_names_the_file_for_instance_and_engine(tmp_path: Path) -> None:
    directory = tmp_path / "rings"
    writer = make_writer(directory, instance=0xFEEDFACE, engine=2, slot_count=8)
    with writer:
        assert writer.path == directory / "ring-00000000feedface-dp2.bin"
        assert os.listdir(directory) == [writer.path.name]  # no temporary file left behind
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(writer.path.stat().st_mode) == 0o600
        assert (writer.hidden_size, writer.slot_count, writer.layers) == (HIDDEN, 8, (1,))
        assert writer.shape.slot_size == slot_size_for(HIDDEN, 1, MODEL)
        assert writer.header.engine == 2 and writer.header.instance == 0xFEEDFACE
        assert writer.header.writer_pid == os.getpid()
        assert writer.epoch != 0
        assert writer.publish_count() == 0
        assert writer.path.stat().st_size == writer.shape.file_size


def test_modes_for_a_shared_group(tmp_path: Path) -> None:
    writer = RingWriter.create(
        tmp_path / "rings",
        hidden_size=HIDDEN,
        model=MODEL,
        slot_count=2,
        dir_mode=0o750,
        file_mode=0o640,
    )
    with writer:
        assert stat.S_IMODE((tmp_path / "rings").stat().st_mode) == 0o750
        assert stat.S_IMODE(writer.path.stat().st_mode) == 0o640


def test_the_captured_layers_are_sorted_and_deduplicated(tmp_path: Path) -> None:
    with make_writer(tmp_path, num_hidden_layers=12, layers=[12, 4, 8, 4]) as writer:
        assert writer.layers == (4, 8, 12)
        assert writer.shape.num_hidden_layers == 12
        assert writer.shape.slot_size == slot_size_for(HIDDEN, 3, MODEL)
    with make_writer(tmp_path, num_hidden_layers=12) as writer:
        assert writer.layers == (12,)  # default: the final layer only


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"model": 5}, TypeError),
        ({"model": "bad \udc80"}, UnicodeEncodeError),
        ({"slot_count": True}, TypeError),
        ({"slot_count": 0}, ValueError),
        ({"slot_count": MAX_SLOT_COUNT + 1}, ValueError),
        ({"hidden_size": 0}, ValueError),
        ({"instance": -1}, ValueError),
        ({"instance": 1 << 64}, ValueError),
        ({"engine": 1 << 31}, ValueError),
        ({"file_mode": 0o660}, ValueError),
        ({"file_mode": 0o666}, ValueError),
        ({"layers": []}, ValueError),
        ({"layers": [5]}, ValueError),
        ({"layers": [-1]}, ValueError),
        ({"num_hidden_layers": 0}, ValueError),
    ],
)
def test_create_refuses_bad_arguments_and_leaves_nothing(
    tmp_path: Path, overrides: dict[str, object], error: type[Exception]
) -> None:
    arguments: dict[str, object] = {
        "hidden_size": HIDDEN,
        "model": MODEL,
        "slot_count": 4,
        "num_hidden_layers": 4,
    }
    arguments.update(overrides)
    with pytest.raises(error):
        RingWriter.create(tmp_path / "rings", **arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "rings").exists() or os.listdir(tmp_path / "rings") == []


# ---------------------------------------------------------------------------------------------
# publishing
# ---------------------------------------------------------------------------------------------


def test_publish_counts_and_records_are_readable(tmp_path: Path) -> None:
    with make_writer(tmp_path, num_hidden_layers=4, layers=(0, 2, 4)) as writer:
        publish_index(writer, 0)
        publish_index(writer, 1, layers=(2, 0), pooling="mean")
        writer.publish_error(key_for(2), "no hidden states for this request")
        assert writer.publish_count() == 3
        with RingReader.open(writer.path) as reader:
            assert reader.publish_count() == 3
            assert_is_record_of(reader.lookup(key_for(0)), 0, layers=(4,))
            assert_is_record_of(reader.lookup(key_for(1)), 1, layers=(2, 0), pooling="mean")
            assert reader.lookup(key_for(2)) == ErrorRecord(
                key_for(2), "no hidden states for this request"
            )


@pytest.mark.parametrize(
    ("key", "size", "details", "message"),
    [
        (key_for(1), 4 * HIDDEN - 1, {}, "vectors must be"),
        (key_for(1), 8 * HIDDEN, {}, "vectors must be"),
        (b"short", 4 * HIDDEN, {}, "key must be 16 bytes"),
        (bytearray(key_for(1)), 4 * HIDDEN, {}, "key must be 16 bytes"),
        (bytes(16), 4 * HIDDEN, {}, "all-zero key"),
        (key_for(1), 4 * HIDDEN, {"position": 1 << 64}, "position out of range"),
        (key_for(1), 4 * HIDDEN, {"position": -1}, "position out of range"),
        (key_for(1), 4 * HIDDEN, {"position": True}, "position must be an int"),
        (key_for(1), 4 * HIDDEN, {"num_prompt_tokens": 1.0}, "num_prompt_tokens must be"),
        (key_for(1), 4 * HIDDEN, {"layers": (3,)}, "not distinct captured layers"),
        (key_for(1), 4 * HIDDEN, {"layers": ()}, "not distinct captured layers"),
        (key_for(1), 8 * HIDDEN, {"layers": (4, 4)}, "not distinct captured layers"),
        (key_for(1), 4 * HIDDEN, {"pooling": "max"}, "pooling must be one of"),
    ],
)
def test_publish_refuses_bad_records_and_writes_nothing(
    tmp_path: Path, key: bytes, size: int, details: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"position": 0, "num_prompt_tokens": 1, **details}
    with make_writer(tmp_path, num_hidden_layers=4, layers=(0, 4)) as writer:
        with pytest.raises(ValueError, match=message):
            writer.publish(key, bytes(size), **arguments)  # type: ignore[arg-type]
        assert writer.publish_count() == 0
        with pytest.raises(ValueError, match="all-zero key"):
            writer.publish_error(bytes(16), "x")


def test_a_closed_writer_refuses_to_publish_and_its_file_stays_readable(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    publish_index(writer, 7)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        publish_index(writer, 8)
    assert writer.path.exists()
    with RingReader.open(writer.path) as reader:
        assert_is_record_of(reader.lookup(key_for(7)), 7)
        assert not reader.is_live()


def test_publishing_from_threads_loses_nothing(tmp_path: Path) -> None:
    with make_writer(tmp_path, slot_count=64) as writer:
        threads = [
            threading.Thread(
                target=lambda t=t: [publish_index(writer, 16 * t + i) for i in range(16)]
            )
            for t in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert writer.publish_count() == 64
        with RingReader.open(writer.path) as reader:
            for i in range(64):
                assert_is_record_of(reader.lookup(key_for(i)), i)


# ---------------------------------------------------------------------------------------------
# one live writer per name
# ---------------------------------------------------------------------------------------------


def test_a_second_writer_for_the_same_engine_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)
    first = make_writer(tmp_path, instance=5, engine=1)
    key = publish_index(first, 0)
    with pytest.raises(RingInUseError) as caught:
        make_writer(tmp_path, instance=5, engine=1)
    message = str(caught.value)
    assert str(first.path) in message and "held by a live writer" in message
    assert "same instance and engine index" in message and RING_DIR_ENV in message
    assert os.listdir(tmp_path) == [first.path.name]  # the loser's temp file is gone
    with RingReader.open(first.path) as reader:
        assert reader.epoch == first.epoch and reader.is_live()  # not replaced
        assert reader.lookup(key) is not None
    # The first writer keeps publishing; other engines and instances are fine beside it.
    publish_index(first, 1)
    make_writer(tmp_path, instance=5, engine=2).close()
    make_writer(tmp_path, instance=6, engine=1).close()
    # Once the first writer is gone, its name is free again: a restart takes it over.
    first.close()
    with make_writer(tmp_path, instance=5, engine=1) as second:
        assert second.path == first.path and second.epoch != first.epoch
        with RingReader.open(second.path) as reader:
            assert reader.epoch == second.epoch
            assert reader.lookup(key) is None


def test_a_new_writer_sweeps_what_dead_writers_left(tmp_path: Path) -> None:
    dead = make_writer(tmp_path, instance=1, engine=0)
    dead.close()
    live = make_writer(tmp_path, instance=2, engine=0)
    young_temp = tmp_path / ".ring-0000000000000003-dp0.abc.tmp"
    write_file(young_temp, b"being made")
    write_file(tmp_path / "ring-0000000000000004-dp0.failed", b"{}")  # a dead note
    with make_writer(tmp_path, instance=3, engine=0) as new:
        assert sorted(os.listdir(tmp_path)) == sorted(
            [live.path.name, new.path.name, young_temp.name]
        )
    live.close()


def test_create_waits_out_a_readers_probe_then_replaces_the_dead_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = make_writer(tmp_path)
    old.close()
    probe = os.open(old.path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)  # a reader probing the dead file's liveness
    real_flock_nb = files.flock_nb

    def probe_ends_after_one_refusal(fd: int, operation: int) -> bool:
        granted = real_flock_nb(fd, operation)
        if operation == fcntl.LOCK_EX and not granted:
            fcntl.flock(probe, fcntl.LOCK_UN)
        return granted

    monkeypatch.setattr(files, "flock_nb", probe_ends_after_one_refusal)
    try:
        with make_writer(tmp_path) as new, RingReader.open(new.path) as reader:
            assert reader.epoch == new.epoch != old.epoch
    finally:
        os.close(probe)


def test_a_shared_lock_held_past_the_wait_looks_like_a_live_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)
    old = make_writer(tmp_path)
    old.close()
    probe = os.open(old.path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    try:
        with pytest.raises(RingInUseError):
            make_writer(tmp_path)
    finally:
        os.close(probe)
    with RingReader.open(old.path) as reader:
        assert reader.epoch == old.epoch  # untouched


def start_creators(
    directory: Path, creators: int, results: list[RingWriter | RingInUseError]
) -> list[threading.Thread]:
    """Threads that create a writer for one name at once; each appends its outcome."""
    barrier = threading.Barrier(creators)

    def start() -> None:
        barrier.wait()
        try:
            results.append(make_writer(directory))
        except RingInUseError as exc:
            results.append(exc)

    threads = [threading.Thread(target=start) for _ in range(creators)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize("existing", ["none", "dead", "dead-probed"])
def test_simultaneous_creators_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: str
) -> None:
    """Creators racing for one name: one wins, the others get RingInUseError.

    "dead-probed": a reader's shared lock on the dead file makes every creator retry on that
    old file; it is released once all four have tried, and then the first to lock it replaces
    it and the others must notice that the name now refers to the winner's live file.
    """
    creators = 4
    monkeypatch.setattr(files, "IN_USE_WAIT", 60.0 if existing == "dead-probed" else 0.01)
    refused: dict[int, int] = {}  # thread -> refused exclusive locks
    all_tried = threading.Event()
    real_flock_nb = files.flock_nb

    def counting_flock_nb(fd: int, operation: int) -> bool:
        granted = real_flock_nb(fd, operation)
        if operation == fcntl.LOCK_EX and not granted:
            refused[threading.get_ident()] = refused.get(threading.get_ident(), 0) + 1
            # The first refusal is the creator's sweep of dead files; later ones its install.
            if len(refused) == creators and min(refused.values()) >= 2:
                all_tried.set()
        return granted

    monkeypatch.setattr(files, "flock_nb", counting_flock_nb)
    for round_ in range(3 if existing == "dead-probed" else 10):
        directory = tmp_path / f"round{round_}"
        if existing != "none":
            make_writer(directory).close()
        probe = -1
        if existing == "dead-probed":
            refused.clear()
            all_tried.clear()
            probe = os.open(directory / "ring-0000000000000000-dp0.bin", os.O_RDONLY)
            fcntl.flock(probe, fcntl.LOCK_SH)
        results: list[RingWriter | RingInUseError] = []
        threads = start_creators(directory, creators, results)
        if probe >= 0:
            assert all_tried.wait(60), "the creators never tried the probed file"
            monkeypatch.setattr(files, "IN_USE_WAIT", 0.01)  # losers give up quickly afterwards
            os.close(probe)
        for thread in threads:
            thread.join()
        if existing == "dead-probed":
            monkeypatch.setattr(files, "IN_USE_WAIT", 60.0)
        winners = [result for result in results if isinstance(result, RingWriter)]
        assert len(results) == creators
        assert len(winners) == 1, results
        with RingReader.open(winners[0].path) as reader:
            assert reader.epoch == winners[0].epoch
            assert reader.is_live()
        assert os.listdir(directory) == [winners[0].path.name]
        winners[0].close()


# ---------------------------------------------------------------------------------------------
# the liveness lock follows the process, not its forked children
# ---------------------------------------------------------------------------------------------

FORKING_WRITER = """
writer = make_writer(Path(sys.argv[1]))
forked_r, forked_w = os.pipe()
child = os.fork()  # like vLLM's compile workers: forked after the ring exists
if child == 0:
    os.write(forked_w, b"x")  # fork() has returned here: the at-fork hooks have run
    sys.stdin.read()  # lives until the test closes stdin
    os._exit(0)
os.read(forked_r, 1)
print(child, flush=True)
sys.stdin.read()
"""


def test_a_forked_child_does_not_keep_a_dead_writers_ring_alive(tmp_path: Path) -> None:
    with python_script(FORKING_WRITER, str(tmp_path)) as process:
        child = int(read_line(process))
        try:
            (name,) = os.listdir(tmp_path)
            with RingReader.open(tmp_path / name) as reader:
                assert reader.is_live()
                process.send_signal(signal.SIGKILL)
                assert process.wait(timeout=30) == -signal.SIGKILL
                # The parent is gone; its forked child (holding copies of every descriptor it
                # did not drop) is not.
                os.kill(child, 0)
                assert not reader.is_live()
        finally:
            os.kill(child, signal.SIGKILL)
        assert wait_until(lambda: not _running(child))


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
