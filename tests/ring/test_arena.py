"""The ring's arena (ring/writer.py, ring/reader.py): matrix records of any size up to the
ring's max record, written round and round; a record whose block newer ones have written over
is an error record (503) naming the arena, never rows of another record."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.ring.helpers import HIDDEN, key_for, make_writer
from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.ring.arena_space import ArenaFull
from vllm_hidden_state_proxy.ring.layout import ARENA_PAYLOAD_OFFSET, arena_block_size, parse_header
from vllm_hidden_state_proxy.ring.records import ErrorRecord, Record
from vllm_hidden_state_proxy.ring.writer import RingWriter

LAYERS = (0, 1)


def matrix(seed: int, rows: int, layers: int = len(LAYERS)) -> bytes:
    values = np.random.default_rng(seed).standard_normal((layers, rows, HIDDEN))
    return values.astype("<f4").tobytes()


def arena_writer(tmp_path: Path, arena_size: int, max_record: int | None = None) -> RingWriter:
    return make_writer(
        tmp_path,
        LAYERS,
        num_hidden_layers=1,
        slot_count=64,
        arena_size=arena_size,
        max_record=max_record,
    )


def publish_matrix(writer: RingWriter, index: int, rows: int, pooling: str = "all_prompt") -> bytes:
    data = matrix(index, rows)
    writer.publish(
        key_for(index),
        data,
        position=0,
        num_prompt_tokens=rows,
        layers=LAYERS,
        pooling=pooling,
        rows=rows,
    )
    return data


def test_a_matrix_record_comes_back_row_for_row(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 20) as writer, RingReader.open(writer.path) as reader:
        data = publish_matrix(writer, 1, rows=7)
        found = reader.lookup(key_for(1))
        assert isinstance(found, Record)
        assert (found.rows, found.pooling, found.layers) == (7, "all_prompt", LAYERS)
        assert found.vectors == data
        size = 7 * HIDDEN * 4
        assert found.vector(1) == data[size:]
        assert found.first_rows(3).vector(1) == data[size : size + 3 * HIDDEN * 4]
        assert found.first_rows(3).rows == 3


def test_the_header_carries_the_arena_and_the_max_record(tmp_path: Path) -> None:
    with arena_writer(tmp_path, (1 << 20) + 5, 4096) as writer:
        raw = writer.path.read_bytes()
        header = parse_header(raw, len(raw))
        assert (header.shape.arena_size, header.shape.max_record) == (1 << 20, 4096)
        assert header.shape.file_size == header.shape.arena_offset + (1 << 20)


def test_blocks_written_over_are_errors_naming_the_arena(tmp_path: Path) -> None:
    rows = 5
    block = arena_block_size(rows * len(LAYERS) * HIDDEN * 4)
    with arena_writer(tmp_path, 3 * block) as writer, RingReader.open(writer.path) as reader:
        written = {i: publish_matrix(writer, i, rows) for i in range(1, 8)}
        for index in range(1, 8):
            found = reader.lookup(key_for(index))
            if index <= 4:  # the arena holds the newest three
                assert isinstance(found, ErrorRecord), index
                assert found.status == 503
                assert ARENA_MIB_ENV in found.message
            else:
                assert isinstance(found, Record) and found.vectors == written[index]


def test_a_block_that_does_not_fit_before_the_end_starts_over(tmp_path: Path) -> None:
    small = arena_block_size(1 * len(LAYERS) * HIDDEN * 4)
    big_rows = 4
    big = arena_block_size(big_rows * len(LAYERS) * HIDDEN * 4)
    with arena_writer(tmp_path, big + 2 * small) as writer, RingReader.open(writer.path) as reader:
        publish_matrix(writer, 1, 1)
        publish_matrix(writer, 2, 1)
        publish_matrix(writer, 3, 1)  # after two smalls: room for one more before the end
        data = publish_matrix(writer, 4, big_rows)  # from the start: 1 and 2 (and 3) go
        for index in (1, 2, 3):
            assert isinstance(reader.lookup(key_for(index)), ErrorRecord), index
        found = reader.lookup(key_for(4))
        assert isinstance(found, Record) and found.vectors == data


def test_a_torn_block_is_never_returned(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 16) as writer, RingReader.open(writer.path) as reader:
        publish_matrix(writer, 1, 3)
        shape = writer.shape
        with open(writer.path, "r+b") as f:  # one payload byte changed: the CRC differs
            f.seek(shape.arena_offset + ARENA_PAYLOAD_OFFSET + 10)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        found = reader.lookup(key_for(1))
        assert isinstance(found, ErrorRecord) and found.status == 503


def test_a_block_of_another_key_is_never_returned(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 16) as writer, RingReader.open(writer.path) as reader:
        publish_matrix(writer, 1, 3)
        with open(writer.path, "r+b") as f:
            f.seek(writer.shape.arena_offset + 8)
            f.write(key_for(2))
        found = reader.lookup(key_for(1))
        assert isinstance(found, ErrorRecord) and found.status == 503


def test_a_matrix_over_the_max_record_is_refused_by_the_writer(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 16, 64) as writer, pytest.raises(ValueError, match="max"):
        publish_matrix(writer, 1, 3)


@pytest.mark.parametrize(("arena", "max_record"), [(1 << 16, (1 << 16) + 64), (-64, None)])
def test_impossible_arenas_are_refused_at_creation(
    tmp_path: Path, arena: int, max_record: int | None
) -> None:
    with pytest.raises(ValueError, match="arena"):
        arena_writer(tmp_path, arena, max_record)


def test_a_header_whose_max_record_exceeds_its_arena_is_refused(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 16) as writer:
        raw = bytearray(writer.path.read_bytes())
    struct.pack_into("<Q", raw, 128, (1 << 16) + 64)
    with pytest.raises(Exception, match="arena"):
        parse_header(bytes(raw), len(raw))


def test_a_vector_pooling_with_rows_is_refused(tmp_path: Path) -> None:
    with arena_writer(tmp_path, 1 << 16) as writer, pytest.raises(ValueError, match="rows"):
        writer.publish(
            key_for(1),
            matrix(1, 2),
            position=0,
            num_prompt_tokens=2,
            layers=LAYERS,
            pooling="mean",
            rows=2,
        )


@pytest.mark.parametrize("status", [413, 503])
def test_error_records_carry_their_status(tmp_path: Path, status: int) -> None:
    with arena_writer(tmp_path, 0) as writer, RingReader.open(writer.path) as reader:
        writer.publish_error(key_for(1), "too big", status)
        writer.publish_error(key_for(2), "failed")
        assert reader.lookup(key_for(1)) == ErrorRecord(key_for(1), "too big", status)
        assert reader.lookup(key_for(2)) == ErrorRecord(key_for(2), "failed", 502)


def test_many_rounds_of_mixed_sizes_return_only_whole_records(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with arena_writer(tmp_path, 1 << 15) as writer, RingReader.open(writer.path) as reader:
        written: dict[int, bytes] = {}
        for index in range(1, 200):
            written[index] = publish_matrix(writer, index, int(rng.integers(1, 9)))
            for probe in rng.integers(1, index + 1, size=3):
                found = reader.lookup(key_for(int(probe)))
                if isinstance(found, Record):
                    assert found.vectors == written[int(probe)]
                else:
                    assert found is None or found.status == 503
        newest = reader.lookup(key_for(199))
        assert isinstance(newest, Record) and newest.vectors == written[199]


def test_a_reader_racing_the_writer_gets_whole_records_or_errors(tmp_path: Path) -> None:
    """A writer thread goes round a small arena while the main thread reads: every record read
    is exactly the one published under its key; the rest are misses or 503s."""

    rows = 6
    block = arena_block_size(rows * len(LAYERS) * HIDDEN * 4)
    published = 0
    with arena_writer(tmp_path, 4 * block) as writer, RingReader.open(writer.path) as reader:
        stop = threading.Event()

        def write() -> None:
            nonlocal published
            index = 1
            while not stop.is_set():
                publish_matrix(writer, index, rows)
                published = index
                index += 1

        thread = threading.Thread(target=write)
        thread.start()
        whole = overwritten = 0
        deadline = time.monotonic() + 20
        try:
            while (whole < 200 or overwritten < 20) and time.monotonic() < deadline:
                newest = published
                if newest < 1:
                    time.sleep(0.001)
                    continue
                for index in (newest, max(1, newest - 3), max(1, newest - 8)):
                    found = reader.lookup(key_for(index))
                    if isinstance(found, Record):
                        assert found.vectors == matrix(index, rows)
                        whole += 1
                    elif isinstance(found, ErrorRecord):
                        assert found.status == 503
                        overwritten += 1
        finally:
            stop.set()
            thread.join()
        assert whole > 0 and overwritten > 0


# -- reservations (ring/arena_space.py): what is accepted fits until it is published ----------


def payload_rows(size: int) -> int:
    """Rows of a matrix of ``size`` payload bytes (LAYERS layers)."""
    row = len(LAYERS) * HIDDEN * 4
    assert size % row == 0
    return size // row


def publish_reserved(writer: RingWriter, index: int, rows: int, region: int) -> bytes:
    data = matrix(index, rows)
    writer.publish(
        key_for(index),
        data,
        position=0,
        num_prompt_tokens=rows,
        layers=LAYERS,
        pooling="all_prompt",
        rows=rows,
        region=region,
    )
    return data


@pytest.mark.parametrize("arena", [1 << 12, 1 << 16])
def test_a_matrix_of_exactly_the_max_record_does_not_fit_its_block(
    tmp_path: Path, arena: int
) -> None:
    """The max record is a block's: header and payload. A payload of exactly the max record
    (here also the arena's size, or far less) is refused at reservation, not when written."""
    max_record = 1 << 12
    rows = payload_rows(max_record)
    with arena_writer(tmp_path, arena, max_record) as writer:
        with pytest.raises(ArenaFull) as refused:
            writer.space.reserve(max_record)
        assert refused.value.reason == "large"
        with pytest.raises(ValueError, match="max record"):
            publish_matrix(writer, 1, rows)
        assert writer.space.reserved == 0


def test_a_matrix_filling_the_arena_with_its_header_is_written_from_anywhere(
    tmp_path: Path,
) -> None:
    arena = 1 << 12
    big = payload_rows(arena - ARENA_PAYLOAD_OFFSET)  # its block is the whole arena
    with arena_writer(tmp_path, arena) as writer, RingReader.open(writer.path) as reader:
        publish_matrix(writer, 1, 1)  # the head is past the start now
        data = publish_matrix(writer, 2, big)
        found = reader.lookup(key_for(2))
        assert isinstance(found, Record) and found.vectors == data
        assert isinstance(reader.lookup(key_for(1)), ErrorRecord)


def test_quarter_arena_matrices_the_fourth_is_refused_at_reservation(tmp_path: Path) -> None:
    """Four matrices of a quarter of the arena each: their payloads fit, their blocks do not.
    The fourth is refused when it is reserved; the three accepted are read whole, in whatever
    order they are published."""
    arena = 1 << 14
    rows = payload_rows(arena // 4)
    with arena_writer(tmp_path, arena) as writer, RingReader.open(writer.path) as reader:
        regions = [writer.space.reserve(arena // 4) for _ in range(3)]
        with pytest.raises(ArenaFull) as refused:
            writer.space.reserve(arena // 4)
        assert refused.value.reason == "busy"
        written = {
            index: publish_reserved(writer, index, rows, regions[index - 1]) for index in (3, 1, 2)
        }
        for index, data in written.items():
            found = reader.lookup(key_for(index))
            assert isinstance(found, Record) and found.vectors == data, index


def test_a_reserved_region_is_never_written_over(tmp_path: Path) -> None:
    """Matrices published around a reserved one wrap the arena: they write over each other,
    skipping the region still reserved (it does not hold them up), never over it; it is
    written whole when its turn comes."""
    rows = 3
    size = rows * len(LAYERS) * HIDDEN * 4
    block = arena_block_size(size)
    with arena_writer(tmp_path, 4 * block) as writer, RingReader.open(writer.path) as reader:
        region = writer.space.reserve(size)  # the arena's first block
        for index in (2, 3, 4, 5):  # 5 wraps round: past the reserved region, over 2
            publish_matrix(writer, index, rows)
        assert isinstance(reader.lookup(key_for(2)), ErrorRecord)
        for index in (3, 4, 5):
            assert isinstance(reader.lookup(key_for(index)), Record), index
        writer.space.reserve(size)  # 6 goes past 5, over 3
        with pytest.raises(ArenaFull):
            writer.space.reserve(2 * size)  # no place of two blocks without a reserved one
        data = publish_reserved(writer, 1, rows, region)
        found = reader.lookup(key_for(1))
        assert isinstance(found, Record) and found.vectors == data


def test_a_region_given_back_is_free_again(tmp_path: Path) -> None:
    arena = 1 << 14
    with arena_writer(tmp_path, arena) as writer:
        regions = [writer.space.reserve(arena // 4) for _ in range(3)]
        writer.space.release(regions[0])
        writer.space.release(regions[0])  # twice: nothing more
        writer.space.reserve(arena // 4)
        assert writer.space.reserved == 3 * arena_block_size(arena // 4)


def test_the_payload_is_read_from_a_buffer_once(tmp_path: Path) -> None:
    """A matrix's payload may be any buffer (a numpy array's bytes, a memoryview slice): the
    writer takes its crc and copies it into the ring without making bytes of it first."""
    rows = 5
    values = np.random.default_rng(3).standard_normal((len(LAYERS) * rows, HIDDEN))
    array = np.ascontiguousarray(values.astype("<f4"))
    with arena_writer(tmp_path, 1 << 16) as writer, RingReader.open(writer.path) as reader:
        whole = memoryview(array.data).cast("B")
        writer.publish(
            key_for(1),
            whole[: array.nbytes],
            position=0,
            num_prompt_tokens=rows,
            layers=LAYERS,
            pooling="all_prompt",
            rows=rows,
        )
        found = reader.lookup(key_for(1))
        assert isinstance(found, Record) and found.vectors == array.tobytes()


def test_a_matrix_larger_than_its_region_is_refused(tmp_path: Path) -> None:
    rows = 3
    size = rows * len(LAYERS) * HIDDEN * 4
    with arena_writer(tmp_path, 1 << 16) as writer:
        region = writer.space.reserve(size - 64)
        with pytest.raises(ValueError, match="larger than its region"):
            publish_reserved(writer, 1, rows, region)
        with pytest.raises(ValueError, match="no region"):
            publish_reserved(writer, 2, rows, 12345)
        assert writer.space.reserved == 0  # the refused one's region went back


def test_reservations_published_in_any_order_keep_their_promise(tmp_path: Path) -> None:
    """Random reservations, published in random order: a published block is read whole until
    a region reserved after its publication is written; a refused reservation is the only
    way a matrix does not fit."""
    rng = np.random.default_rng(7)
    row = len(LAYERS) * HIDDEN * 4
    with arena_writer(tmp_path, 1 << 11) as writer, RingReader.open(writer.path) as reader:
        clock = 0
        pending: dict[int, tuple[int, int, int]] = {}  # index -> (region, rows, reserved at)
        safe: dict[int, tuple[bytes, int]] = {}  # index -> (data, published at)
        refused = 0
        for index in range(1, 400):
            clock += 1
            if rng.random() < 0.55 and len(pending) < 5:
                rows = int(rng.integers(1, 12))
                try:
                    pending[index] = (writer.space.reserve(rows * row), rows, clock)
                except ArenaFull as full:
                    assert full.reason == "busy"
                    refused += 1
                continue
            if not pending:
                continue
            chosen = int(rng.choice(list(pending)))
            region, rows, reserved_at = pending.pop(chosen)
            data = publish_reserved(writer, chosen, rows, region)
            for gone in [i for i, (_, at) in safe.items() if at < reserved_at]:
                del safe[gone]  # reserved after they were published: may write them over
            safe[chosen] = (data, clock)
            for kept, (kept_data, _) in safe.items():
                found = reader.lookup(key_for(kept))
                assert isinstance(found, Record) and found.vectors == kept_data, kept
        assert refused > 0
