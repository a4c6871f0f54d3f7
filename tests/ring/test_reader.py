"""The proxy's side of one ring (ring/reader.py): open and validate, find a record by its key,
prove what was read, follow the key map incrementally, never return another key's record."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgpack
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
    ready_header,
    record_of,
    shape_for,
    vectors_for,
    wait_until,
    write_file,
)
from vllm_hidden_state_proxy.ring import (
    ErrorRecord,
    Record,
    RingFormatError,
    RingReader,
    RingWriter,
)
from vllm_hidden_state_proxy.ring.layout import (
    HDR_PUBLISH_COUNT_OFFSET,
    KEY_BYTES,
    SLOT_CRC_OFFSET,
    SLOT_KEY_OFFSET,
    SLOT_LEN_OFFSET,
    SLOT_PAYLOAD_OFFSET,
    SLOT_SEQ_OFFSET,
    RingShape,
)
from vllm_hidden_state_proxy.ring.records import (
    MAX_ERROR_CHARS,
)


def slot_at(shape: RingShape, slot: int) -> int:
    return shape.slots_offset + slot * shape.slot_size


def index_at(shape: RingShape, slot: int) -> int:
    return shape.index_offset + slot * KEY_BYTES


@pytest.fixture
def rings(tmp_path: Path) -> Iterator[tuple[RingWriter, RingReader, mmap.mmap]]:
    """A writer (4 slots), a reader, and a writable mapping for tampering with the file."""
    writer = make_writer(tmp_path / "rings")
    reader = RingReader.open(writer.path)
    with open(writer.path, "r+b") as f:
        scribble = mmap.mmap(f.fileno(), 0)
    yield writer, reader, scribble
    scribble.close()
    reader.close()
    writer.close()


# ---------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------


def test_a_record_round_trips_with_every_field(tmp_path: Path) -> None:
    writer = make_writer(tmp_path, instance=9, engine=4, slot_count=8, hidden_size=16)
    values = [j * 0.5 - 3.0 for j in range(16)]
    key = bytes(range(1, 17))
    writer.publish(key, struct.pack("<16f", *values), position=41, num_prompt_tokens=42)
    with writer, RingReader.open(writer.path) as reader:
        assert reader.shape == writer.shape
        assert (reader.hidden_size, reader.slot_count, reader.layers) == (16, 8, (1,))
        assert (reader.header.engine, reader.header.instance, reader.epoch) == (4, 9, writer.epoch)
        assert reader.header.writer_pid == os.getpid()
        st = writer.path.stat()
        assert reader.identity == (st.st_dev, st.st_ino)
        assert reader.publish_count() == 1
        record = reader.lookup(key)
        assert record == Record(
            key=key,
            model=MODEL,
            position=41,
            num_prompt_tokens=42,
            pooling="last",
            layers=(1,),
            hidden_size=16,
            vectors=struct.pack("<16f", *values),
        )
        assert record.floats(1) == values
        assert reader.lookup(bytes(range(2, 18))) is None


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_records_with_several_layers(tmp_path: Path, pooling: str) -> None:
    with make_writer(tmp_path, num_hidden_layers=6, layers=(0, 3, 6)) as writer:
        publish_index(writer, 0, layers=(6, 0, 3), pooling=pooling)
        publish_index(writer, 1, layers=(3,), pooling=pooling)
        with RingReader.open(writer.path) as reader:
            assert reader.layers == (0, 3, 6)
            first = reader.lookup(key_for(0))
            assert_is_record_of(first, 0, layers=(6, 0, 3), pooling=pooling)
            assert isinstance(first, Record)
            for layer in (0, 3, 6):
                assert first.vector(layer) == vectors_for(key_for(0), HIDDEN, (layer,))
            assert_is_record_of(reader.lookup(key_for(1)), 1, layers=(3,), pooling=pooling)


def test_error_records_round_trip(tmp_path: Path) -> None:
    with make_writer(tmp_path) as writer, RingReader.open(writer.path) as reader:
        writer.publish_error(key_for(1), "CUDA error: out of memory")
        writer.publish_error(key_for(2), "ü" * (MAX_ERROR_CHARS + 1))
        assert reader.lookup(key_for(1)) == ErrorRecord(key_for(1), "CUDA error: out of memory")
        assert reader.lookup(key_for(2)) == ErrorRecord(key_for(2), "ü" * MAX_ERROR_CHARS)


@pytest.mark.parametrize(
    "key", [b"", b"k" * 15, b"k" * 17, bytes(KEY_BYTES), bytearray(key_for(0)), "k" * 16]
)
def test_malformed_keys_are_misses(
    rings: tuple[RingWriter, RingReader, mmap.mmap], key: object
) -> None:
    writer, reader, _ = rings
    publish_index(writer, 0)
    assert reader.lookup(key) is None  # type: ignore[arg-type]
    assert reader.lookup(key_for(0)) is not None


def test_a_closed_reader_misses_and_counts_nothing(tmp_path: Path) -> None:
    with make_writer(tmp_path) as writer:
        publish_index(writer, 0)
        reader = RingReader.open(writer.path)
        reader.close()
        reader.close()  # idempotent
        assert reader.lookup(key_for(0)) is None
        assert reader.publish_count() == 0
        assert not reader.is_live()


# ---------------------------------------------------------------------------------------------
# the key map: only new index entries are read, wrap-around and slot reuse handled
# ---------------------------------------------------------------------------------------------


def test_wrap_around_keeps_the_newest_slot_count_records(tmp_path: Path) -> None:
    with make_writer(tmp_path, slot_count=4) as writer:
        for i in range(10):
            publish_index(writer, i)
        with RingReader.open(writer.path) as reader:
            assert reader.publish_count() == 10
            for i in range(6):
                assert reader.lookup(key_for(i)) is None
            for i in range(6, 10):
                assert_is_record_of(reader.lookup(key_for(i)), i)


def test_more_than_a_ring_of_publishes_between_two_lookups(tmp_path: Path) -> None:
    with make_writer(tmp_path, slot_count=4) as writer, RingReader.open(writer.path) as reader:
        for i in range(3):
            publish_index(writer, i)
        assert_is_record_of(reader.lookup(key_for(1)), 1)  # the map knows records 0..2
        for i in range(3, 3 + 2 * 4 + 1):  # more than twice around
            publish_index(writer, i)
        for i in range(8):
            assert reader.lookup(key_for(i)) is None
        for i in range(8, 12):
            assert_is_record_of(reader.lookup(key_for(i)), i)


def test_an_overwritten_key_is_no_longer_found_and_never_gives_another_record(
    tmp_path: Path,
) -> None:
    with make_writer(tmp_path, slot_count=4) as writer, RingReader.open(writer.path) as reader:
        for i in range(4):
            publish_index(writer, i)
        for i in range(4):  # every slot mapped
            assert_is_record_of(reader.lookup(key_for(i)), i)
        for i in range(4, 7):  # one at a time: each reuses the oldest slot
            publish_index(writer, i)
            assert reader.lookup(key_for(i - 4)) is None
            assert_is_record_of(reader.lookup(key_for(i)), i)
            for j in range(i - 3, i + 1):
                assert_is_record_of(reader.lookup(key_for(j)), j)


def test_a_stale_map_entry_is_a_miss_never_the_new_record(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    """The map may still point a key at a slot reused since (the reader has not seen the
    counter move): the slot's own key check makes that a miss, never the new record."""
    writer, reader, scribble = rings
    k0 = publish_index(writer, 0)
    assert reader.lookup(k0) is not None
    for i in range(1, 5):  # record 4 reuses slot 0
        publish_index(writer, i)
    struct.pack_into("<Q", scribble, HDR_PUBLISH_COUNT_OFFSET, 1)  # as the reader last saw it
    assert reader.lookup(k0) is None
    assert reader.lookup(key_for(4)) is None  # not in the stale map yet
    struct.pack_into("<Q", scribble, HDR_PUBLISH_COUNT_OFFSET, 5)
    assert_is_record_of(reader.lookup(key_for(4)), 4)
    assert reader.lookup(k0) is None


@pytest.mark.parametrize("behind", [False, True], ids=["kept-up", "fell-behind"])
def test_a_key_published_twice_gives_the_newest_record(tmp_path: Path, behind: bool) -> None:
    """Whether the reader kept up or rescans every slot, a key in two slots maps to the newer
    one, and stays found until that one is reused."""
    twice = key_for(99)

    def publish_twice_after(writer: RingWriter, i: int) -> None:
        writer.publish(twice, vectors_for(twice, HIDDEN, (1,)), position=i, num_prompt_tokens=i + 1)

    with make_writer(tmp_path, slot_count=4) as writer, RingReader.open(writer.path) as reader:
        order: list[int | str] = [0, 1, "twice", 2, "twice"]  # slots 0, 1, 2, 3, then 0 again
        for position, item in enumerate(order):
            if item == "twice":
                publish_twice_after(writer, 100 + position)
            else:
                publish_index(writer, int(item))
            if not behind:
                reader.lookup(key_for(0))
        found = reader.lookup(twice)
        assert isinstance(found, Record) and found.position == 104
        publish_index(writer, 3)  # reuses slot 1
        publish_index(writer, 4)  # reuses slot 2: the older copy
        found = reader.lookup(twice)
        assert isinstance(found, Record) and found.position == 104


def test_the_reader_reads_only_new_index_entries(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    """Index entries already read are not read again while the publish counter stands still
    (or moves on): a forged entry in an old slot stays unseen."""
    writer, reader, scribble = rings
    k0, k1 = publish_index(writer, 0), publish_index(writer, 1)
    assert reader.lookup(k0) is not None and reader.lookup(k1) is not None
    forged = key_for(50)
    at = index_at(writer.shape, 0)
    scribble[at : at + KEY_BYTES] = forged  # slot 0 still holds k0's record
    assert reader.lookup(forged) is None  # the entry was read before it changed
    assert_is_record_of(reader.lookup(k0), 0)
    publish_index(writer, 2)  # the counter moves: only slot 2's entry is new
    assert reader.lookup(forged) is None
    assert_is_record_of(reader.lookup(k0), 0)
    assert_is_record_of(reader.lookup(key_for(2)), 2)
    with RingReader.open(writer.path) as fresh:  # a new reader reads the whole index
        assert fresh.lookup(forged) is None  # mapped to slot 0, whose key is k0's: a miss
        assert fresh.lookup(k0) is None  # its entry is gone


def test_a_publish_counter_that_goes_back_makes_a_full_rescan(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    writer, reader, scribble = rings
    for i in range(3):
        publish_index(writer, i)
    assert reader.lookup(key_for(2)) is not None
    struct.pack_into("<Q", scribble, HDR_PUBLISH_COUNT_OFFSET, 1)
    for i in range(3):
        assert_is_record_of(reader.lookup(key_for(i)), i)
    struct.pack_into("<Q", scribble, HDR_PUBLISH_COUNT_OFFSET, (1 << 64) - 1)
    for i in range(3):
        assert_is_record_of(reader.lookup(key_for(i)), i)


# ---------------------------------------------------------------------------------------------
# tampering: the reader proves what it read
# ---------------------------------------------------------------------------------------------


def test_an_odd_seq_means_the_writer_is_at_work(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    at = slot_at(writer.shape, 0) + SLOT_SEQ_OFFSET
    (seq,) = struct.unpack_from("<Q", scribble, at)
    struct.pack_into("<Q", scribble, at, seq + 1)
    assert reader.lookup(key) is None
    struct.pack_into("<Q", scribble, at, seq)
    assert_is_record_of(reader.lookup(key), 0)


def test_a_corrupt_payload_fails_the_crc(rings: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    at = slot_at(writer.shape, 0) + SLOT_PAYLOAD_OFFSET + 40
    scribble[at] ^= 0xFF
    assert reader.lookup(key) is None
    scribble[at] ^= 0xFF
    assert_is_record_of(reader.lookup(key), 0)


def test_a_changed_slot_key_is_a_miss(rings: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    at = slot_at(writer.shape, 0) + SLOT_KEY_OFFSET
    scribble[at : at + KEY_BYTES] = key_for(99)
    assert reader.lookup(key) is None
    assert reader.lookup(key_for(99)) is None  # not in the index
    scribble[at : at + KEY_BYTES] = key
    assert_is_record_of(reader.lookup(key), 0)


def test_an_oversized_length_is_a_miss(rings: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    at = slot_at(writer.shape, 0) + SLOT_LEN_OFFSET
    (length,) = struct.unpack_from("<I", scribble, at)
    for bad in (0xFFFFFFFF, writer.shape.payload_capacity + 1):
        struct.pack_into("<I", scribble, at, bad)
        assert reader.lookup(key) is None
    struct.pack_into("<I", scribble, at, length)
    assert reader.lookup(key) is not None


def forge_payload(
    scribble: mmap.mmap, shape: RingShape, slot: int, payload: dict[str, object]
) -> None:
    """Put ``payload`` in ``slot`` with a correct length and CRC."""
    packed = msgpack.packb(payload, use_bin_type=True)
    at = slot_at(shape, slot)
    scribble[at + SLOT_PAYLOAD_OFFSET : at + SLOT_PAYLOAD_OFFSET + len(packed)] = packed
    struct.pack_into("<II", scribble, at + SLOT_LEN_OFFSET, len(packed), zlib.crc32(packed))
    assert SLOT_CRC_OFFSET == SLOT_LEN_OFFSET + 4


def test_a_payload_for_another_key_is_a_miss_despite_a_valid_crc(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    other = record_of(5)
    forge_payload(
        scribble,
        writer.shape,
        0,
        {
            "key": other.key,
            "model": MODEL,
            "position": 5,
            "num_prompt_tokens": 6,
            "pooling": "last",
            "layers": [1],
            "vectors": other.vectors,
        },
    )
    assert reader.lookup(key) is None
    assert reader.lookup(other.key) is None


def test_a_payload_with_a_layer_the_ring_does_not_capture_is_a_miss(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    writer, reader, scribble = rings
    key = publish_index(writer, 0)
    forge_payload(
        scribble,
        writer.shape,
        0,
        {
            "key": key,
            "model": MODEL,
            "position": 0,
            "num_prompt_tokens": 1,
            "pooling": "last",
            "layers": [0],
            "vectors": vectors_for(key, HIDDEN, (0,)),
        },
    )
    assert reader.lookup(key) is None


def test_a_forged_index_never_yields_another_keys_record(
    rings: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    writer, _, scribble = rings
    k0, k1 = publish_index(writer, 0), publish_index(writer, 1)
    # The index claims k0 lives in slot 1 (which holds k1's record) and forgets slot 0.
    scribble[index_at(writer.shape, 0) : index_at(writer.shape, 1)] = bytes(KEY_BYTES)
    scribble[index_at(writer.shape, 1) : index_at(writer.shape, 2)] = k0
    with RingReader.open(writer.path) as reader:
        assert reader.lookup(k0) is None
    # Also forge slot 1's key field to k0: the payload (valid CRC) still says k1.
    at = slot_at(writer.shape, 1) + SLOT_KEY_OFFSET
    scribble[at : at + KEY_BYTES] = k0
    with RingReader.open(writer.path) as reader:
        assert reader.lookup(k0) is None
        assert reader.lookup(k1) is None  # lost its index entry
    # Restoring slot 0's entry makes k0 findable again: the setup is not vacuous.
    scribble[index_at(writer.shape, 0) : index_at(writer.shape, 1)] = k0
    scribble[index_at(writer.shape, 1) : index_at(writer.shape, 2)] = k1
    with RingReader.open(writer.path) as reader:
        assert_is_record_of(reader.lookup(k0), 0)


# ---------------------------------------------------------------------------------------------
# opening: what a reader refuses
# ---------------------------------------------------------------------------------------------


def test_open_refuses_untrusted_files_naming_them(tmp_path: Path) -> None:
    with make_writer(tmp_path / "rings") as writer:
        uid = writer.path.stat().st_uid
        with pytest.raises(RingFormatError, match=f"{writer.path}: owned by uid {uid}"):
            RingReader.open(writer.path, owner_uids=uid + 1)
        RingReader.open(writer.path, owner_uids=[uid + 1, uid]).close()
        link = tmp_path / "ring-0000000000000001-dp0.bin"
        link.symlink_to(writer.path)
        with pytest.raises(RingFormatError, match="cannot open"):
            RingReader.open(link)
        os.chmod(writer.path, 0o660)
        with pytest.raises(RingFormatError, match="writable by group/others"):
            RingReader.open(writer.path)


def test_open_refuses_a_ring_not_ready_yet(tmp_path: Path) -> None:
    shape = shape_for()
    raw = bytearray(ready_header(shape))
    struct.pack_into("<I", raw, 8, 0)
    path = tmp_path / "ring-0000000000000000-dp0.bin"
    write_file(path, bytes(raw).ljust(shape.file_size, b"\x00"))
    with pytest.raises(RingFormatError, match=f"{path}: not ready"):
        RingReader.open(path)


def test_a_huge_sparse_ring_is_mapped_not_read(tmp_path: Path) -> None:
    """A consistent header describing a 4 GiB ring opens lazily and is looked up without
    reading it all: the reader touches the index entries published and one slot."""
    shape = RingShape(1 << 20, 1 << 12, 4, 1, (1,))
    path = tmp_path / "ring-0000000000000000-dp0.bin"
    raw = bytearray(ready_header(shape))
    struct.pack_into("<Q", raw, HDR_PUBLISH_COUNT_OFFSET, 3)
    with open(path, "wb") as f:
        f.write(raw)
        try:
            f.truncate(shape.file_size)
        except OSError as exc:
            pytest.skip(f"no sparse 4 GiB file here: {exc}")
    os.chmod(path, 0o600)
    try:
        reader = RingReader.open(path)
    except RingFormatError as exc:
        pytest.skip(f"cannot map 4 GiB here: {exc}")
    with reader:
        assert reader.lookup(key_for(0)) is None
        assert reader.publish_count() == 3


# ---------------------------------------------------------------------------------------------
# under a live mapping: truncation, replacement, liveness
# ---------------------------------------------------------------------------------------------


def test_a_file_truncated_after_mapping_raises_instead_of_faulting(tmp_path: Path) -> None:
    with make_writer(tmp_path, slot_count=64) as writer:
        key = publish_index(writer, 0)
        with RingReader.open(writer.path) as reader:
            assert reader.lookup(key) is not None
            os.truncate(writer.path, 100)  # pages past EOF of a live mapping would SIGBUS
            with pytest.raises(RingFormatError, match="truncated after mapping"):
                reader.lookup(key)
            with pytest.raises(RingFormatError, match="truncated after mapping"):
                reader.publish_count()
            assert reader.is_stale()
        with pytest.raises(RingFormatError):
            RingReader.open(writer.path)


def test_a_replaced_file_makes_the_reader_stale_and_its_mapping_still_works(
    tmp_path: Path,
) -> None:
    first = make_writer(tmp_path)
    key = publish_index(first, 1)
    old = RingReader.open(first.path)
    assert not old.is_stale()
    first.close()  # vLLM exited (its lock is released) ...
    with make_writer(tmp_path) as second:  # ... and restarted: same name, new file
        assert old.is_stale()
        with RingReader.open(second.path) as new:
            assert not new.is_stale()
        assert_is_record_of(old.lookup(key), 1)  # the unlinked mapping is still readable
    os.unlink(first.path)
    assert old.is_stale()
    old.close()


def test_liveness_follows_the_writers_lock(tmp_path: Path) -> None:
    writer = make_writer(tmp_path)
    with RingReader.open(writer.path) as reader:
        assert reader.is_live()
        assert reader.is_live()  # a probe does not disturb the writer
        publish_index(writer, 0)
        writer.close()
        assert not reader.is_live()
        assert not reader.is_live()
    copy = tmp_path / "copy"
    copy.mkdir()
    write_file(copy / writer.path.name, writer.path.read_bytes())
    with RingReader.open(copy / writer.path.name) as reader:
        assert not reader.is_live()  # no writer ever held the copy
        assert_is_record_of(reader.lookup(key_for(0)), 0)


HOLDER = """
writer = make_writer(Path(sys.argv[1]))
for i in range(3):
    publish_index(writer, i)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_writer_killed_by_sigkill_is_not_live_and_its_records_stay_exact(
    tmp_path: Path,
) -> None:
    with python_script(HOLDER, str(tmp_path)) as process:
        assert read_line(process) == "ready"
        (name,) = os.listdir(tmp_path)
        with RingReader.open(tmp_path / name) as reader:
            assert reader.is_live()
            assert reader.header.writer_pid == process.pid
            process.send_signal(signal.SIGKILL)
            assert process.wait(timeout=30) == -signal.SIGKILL
            assert not reader.is_live()  # the kernel dropped the lock with the process
            for i in range(3):
                assert_is_record_of(reader.lookup(key_for(i)), i)


# ---------------------------------------------------------------------------------------------
# racing a writer in another process: every hit is exact (seqlock, CRC, key checks)
# ---------------------------------------------------------------------------------------------

RACING_WRITER = """
directory, stop = Path(sys.argv[1]), Path(sys.argv[2])
writer = make_writer(directory, hidden_size=1024, slot_count=8)
print("ready", flush=True)
i = 0
while i % 64 or not stop.exists():
    publish_index(writer, i)
    i += 1
writer.close()
print(i, flush=True)
"""


def test_lookups_racing_a_writer_process_are_exact_or_misses(tmp_path: Path) -> None:
    directory, stop = tmp_path / "rings", tmp_path / "stop"
    hits = 0
    with python_script(RACING_WRITER, str(directory), str(stop)) as process:
        assert read_line(process) == "ready"
        (name,) = os.listdir(directory)
        with RingReader.open(directory / name) as reader:

            def raced_enough() -> bool:
                nonlocal hits
                count = reader.publish_count()
                for i in range(max(0, count - 9), count + 2):
                    found = reader.lookup(key_for(i))
                    if found is not None:
                        assert_is_record_of(found, i, hidden_size=1024)
                        hits += 1
                return hits >= 200 and count >= 2000

            assert wait_until(raced_enough, timeout=120)
            stop.touch()
            total = int(read_line(process))
            assert process.wait(timeout=30) == 0
            assert reader.publish_count() == total
            # Quiescent: the newest 8 are all there and exact, the one before is gone.
            for i in range(total - 8, total):
                assert_is_record_of(reader.lookup(key_for(i)), i, hidden_size=1024)
            assert reader.lookup(key_for(total - 9)) is None
