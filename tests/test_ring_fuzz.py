"""Hostile ring files (issue #7): the proxy side of the ring never trusts what it maps.

tests/test_ring.py already throws random and mutated bytes at ``RingReader.open``. Here the
garbage goes deeper:

- rings whose header is consistent (so they open) but whose index and slots are forged, with a
  correct CRC over arbitrary msgpack: ``lookup`` returns exactly the first valid record for the
  key (checked against the layout rules in ring.py's docstring), never another key's;
- a live ring scribbled over in place while mapped, header included: nothing raises, a record
  published afterwards is still found;
- a directory of garbage (random files, modes, a directory, a FIFO, a socket, symlinks, dead and
  truncated rings) around one live writer: ``has_ring``, ``lookup``, ``publish_count``,
  ``min_slot_count``, ``hidden_size`` never raise and still serve the live ring.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import socket
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_hidden_state_proxy.ring import (
    HEADER_FMT,
    HEADER_SIZE,
    REQUEST_KEY_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    Record,
    RingDirectory,
    RingFormatError,
    RingReader,
    RingWriter,
    slot_size_for,
)

HIDDEN = 4
SLOT_HEADER = 32  # seq u64, key 16, length u32, crc u32 (ring.py's docstring)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def key_for(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=REQUEST_KEY_BYTES).digest()


KEYS = [key_for(i) for i in range(4)]


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name("." + path.name + ".new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def slots_offset(slot_count: int) -> int:
    return (HEADER_SIZE + REQUEST_KEY_BYTES * slot_count + 63) // 64 * 64


# ---------------------------------------------------------------------------------------------
# forged rings: a valid header, then anything
# ---------------------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)), children, max_size=3),
    ),
    max_leaves=8,
)


def mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, other)


def near_records(key: bytes) -> st.SearchStrategy[dict[Any, Any]]:
    """Record maps, each field right most of the time and wrong (type or value) otherwise."""

    return st.fixed_dictionaries(
        {
            "key": mostly(st.just(key), st.sampled_from(KEYS)),
            "vector": mostly(st.binary(min_size=4 * HIDDEN, max_size=4 * HIDDEN), msgpack_values),
            "hidden_size": mostly(st.just(HIDDEN), st.sampled_from([HIDDEN + 1, 0, True])),
            "position": mostly(st.integers(-(1 << 63), (1 << 64) - 1), msgpack_values),
            "num_prompt_tokens": mostly(st.integers(0, 1 << 20), msgpack_values),
            "model": mostly(st.text(max_size=4), msgpack_values),
        },
        optional={"extra": msgpack_values},
    )


@st.composite
def payloads(draw: st.DrawFn, key: bytes) -> bytes:
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "record", "record", "value", "bytes", "ext", "timestamp", "trailing"]
        )
    )
    if kind == "valid":
        vector = draw(st.binary(min_size=4 * HIDDEN, max_size=4 * HIDDEN))
        record = {"key": key, "vector": vector, "hidden_size": HIDDEN, "position": 1}
        record.update(num_prompt_tokens=2, model="m")
        return bytes(msgpack.packb(record, use_bin_type=True))
    if kind == "record":
        packed: bytes = msgpack.packb(draw(near_records(key)), use_bin_type=True)
        return packed
    if kind == "value":
        return bytes(msgpack.packb(draw(msgpack_values), use_bin_type=True))
    if kind == "ext":
        ext = msgpack.ExtType(draw(st.integers(0, 127)), draw(st.binary(max_size=12)))
        return bytes(msgpack.packb({"key": key, "vector": ext}, use_bin_type=True))
    if kind == "timestamp":  # ext type -1: msgpack decodes it to a Timestamp, or fails
        return b"\x81\xa6vector\xd6\xff" + draw(st.binary(min_size=4, max_size=4))
    if kind == "trailing":
        return bytes(msgpack.packb({"key": key}, use_bin_type=True)) + draw(st.binary(max_size=4))
    return draw(st.binary(max_size=60))


@st.composite
def slots(draw: st.DrawFn, key: bytes) -> dict[str, Any]:
    payload = draw(payloads(key))
    return {
        "seq": draw(mostly(st.sampled_from([0, 2, (1 << 64) - 2]), st.sampled_from([1, 3]))),
        "key": draw(mostly(st.just(key), st.sampled_from([*KEYS, bytes(REQUEST_KEY_BYTES)]))),
        "payload": payload,
        "length": draw(mostly(st.just(len(payload)), st.integers(0, (1 << 32) - 1))),
        "crc": draw(mostly(st.none(), st.integers(0, (1 << 32) - 1))),
    }


def build_ring(
    slot_count: int, slot_size: int, index: list[bytes], slot_list: list[dict[str, Any]]
) -> bytes:
    """A ring file from the documented layout, by hand (not through RingWriter)."""
    size = slots_offset(slot_count) + slot_count * slot_size
    data = bytearray(size)
    struct.pack_into(
        HEADER_FMT,
        data,
        0,
        MAGIC,
        LAYOUT_VERSION,
        HEADER_SIZE,
        slot_size,
        slot_count,
        REQUEST_KEY_BYTES,
        HIDDEN,
        12345,
        os.getpid(),
        0,
        len(slot_list),
        0,
    )
    for i, entry in enumerate(index):
        data[HEADER_SIZE + REQUEST_KEY_BYTES * i : HEADER_SIZE + REQUEST_KEY_BYTES * (i + 1)] = (
            entry
        )
    cap = slot_size - SLOT_HEADER
    for i, slot in enumerate(slot_list):
        off = slots_offset(slot_count) + i * slot_size
        payload = slot["payload"][:cap]
        crc = zlib.crc32(payload) if slot["crc"] is None else slot["crc"]
        struct.pack_into("<Q16sII", data, off, slot["seq"], slot["key"], slot["length"], crc)
        data[off + SLOT_HEADER : off + SLOT_HEADER + len(payload)] = payload
    return bytes(data)


def record_in_slot(data: bytes, slot_count: int, slot_size: int, i: int, key: bytes) -> Any:
    """The record slot ``i`` holds for ``key`` per ring.py's docstring, or ``None``."""
    off = slots_offset(slot_count) + i * slot_size
    seq, slot_key, length, crc = struct.unpack_from("<Q16sII", data, off)
    if seq & 1 or slot_key != key or length > slot_size - SLOT_HEADER:
        return None
    payload = data[off + SLOT_HEADER : off + SLOT_HEADER + length]
    if zlib.crc32(payload) != crc:
        return None
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    if type(obj) is not dict:
        return None
    fields = ("key", "vector", "hidden_size", "position", "num_prompt_tokens", "model")
    types = (bytes, bytes, int, int, int, str)
    if any(type(obj.get(name)) is not kind for name, kind in zip(fields, types, strict=True)):
        return None
    if obj["key"] != key or obj["hidden_size"] != HIDDEN or len(obj["vector"]) != 4 * HIDDEN:
        return None
    return Record(*(obj[name] for name in fields))


def expected_lookup(data: bytes, slot_count: int, slot_size: int, key: bytes) -> Any:
    for i in range(slot_count):
        start = HEADER_SIZE + REQUEST_KEY_BYTES * i
        if data[start : start + REQUEST_KEY_BYTES] == key:
            record = record_in_slot(data, slot_count, slot_size, i, key)
            if record is not None:
                return record
    return None


@st.composite
def forged_rings(draw: st.DrawFn) -> tuple[int, int, bytes]:
    slot_count = draw(st.integers(1, 4))
    slot_size = slot_size_for(HIDDEN, "") + 64 * draw(st.integers(0, 1))
    target = draw(st.sampled_from(KEYS))
    entries = st.one_of(
        st.sampled_from(KEYS), st.binary(min_size=REQUEST_KEY_BYTES, max_size=REQUEST_KEY_BYTES)
    )
    index = draw(
        st.lists(mostly(st.just(target), entries), min_size=slot_count, max_size=slot_count)
    )
    slot_list = draw(st.lists(slots(target), min_size=slot_count, max_size=slot_count))
    return slot_count, slot_size, build_ring(slot_count, slot_size, index, slot_list)


@settings(FUZZ, max_examples=500)
@given(
    ring=forged_rings(),
    flips=st.lists(st.tuples(st.integers(0), st.integers(0, 255)), max_size=3),
)
def test_forged_slots_give_exactly_the_valid_record_or_none(
    tmp_path: Path, ring: tuple[int, int, bytes], flips: list[tuple[int, int]]
) -> None:
    slot_count, slot_size, data = ring
    raw = bytearray(data)
    for pos, value in flips:  # past the header, so that the file still opens
        raw[HEADER_SIZE + pos % (len(raw) - HEADER_SIZE)] = value
    data = bytes(raw)
    path = tmp_path / "ring-forged.bin"
    write_file(path, data)
    with RingReader.open(path) as reader:
        assert (reader.slot_count, reader.hidden_size) == (slot_count, HIDDEN)
        for key in KEYS:
            expected = expected_lookup(data, slot_count, slot_size, key)
            found = reader.lookup(key)
            event("record" if found is not None else "miss")
            assert found == expected
            if found is not None:
                assert found.key == key and len(found.as_floats()) == HIDDEN


# ---------------------------------------------------------------------------------------------
# a live ring scribbled over while mapped
# ---------------------------------------------------------------------------------------------


def publish(writer: RingWriter, i: int) -> bytes:
    key = key_for(i)
    writer.publish(key, key[: 4 * HIDDEN], position=i, num_prompt_tokens=i + 1)
    return key


@FUZZ
@given(
    writes=st.lists(
        st.tuples(st.integers(0), st.binary(min_size=1, max_size=40)), min_size=1, max_size=6
    ),
    published=st.integers(0, 6),
)
def test_scribbling_over_a_mapped_live_ring(
    tmp_path: Path, writes: list[tuple[int, bytes]], published: int
) -> None:
    directory = tmp_path / f"rings-{os.urandom(4).hex()}"
    writer = RingWriter.create(
        directory, writer_id="w", hidden_size=HIDDEN, model="m", slot_count=4
    )
    rings = RingDirectory(directory)
    try:
        before = [publish(writer, i) for i in range(published)]
        reader = RingReader.open(writer.path)
        with open(writer.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as scribble:
            for pos, garbage in writes:
                at = pos % len(scribble)
                chunk = garbage[: len(scribble) - at]
                scribble[at : at + len(chunk)] = chunk
            for key in [*before, *KEYS, key_for(99)]:
                for found in (reader.lookup(key), rings.lookup(key)):
                    assert found is None or (found.key == key and found.hidden_size == HIDDEN)
                    event("old record survived" if found is not None else "old record gone")
            assert rings.has_ring()
            assert isinstance(rings.publish_count(), int)
            assert rings.min_slot_count() == 4
            assert rings.hidden_size() == HIDDEN
            # Whatever was scribbled, a record published afterwards is found, intact.
            fresh = publish(writer, 1000)
            for found in (reader.lookup(fresh), rings.lookup(fresh)):
                assert found is not None
                assert (found.key, found.vector, found.position) == (fresh, fresh, 1000)
        reader.close()
    finally:
        rings.close()
        writer.close()


# ---------------------------------------------------------------------------------------------
# a directory of garbage around one live writer
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def unix_socket(path: Path) -> Iterator[None]:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(path))
        yield
    finally:
        sock.close()


def valid_ring_bytes(directory: Path, records: int) -> bytes:
    writer = RingWriter.create(
        directory, writer_id="src", hidden_size=HIDDEN, model="m", slot_count=4
    )
    for i in range(records):
        publish(writer, 100 + i)
    writer.close()
    data = writer.path.read_bytes()
    writer.path.unlink()
    return data


garbage_files = st.lists(
    st.tuples(
        st.sampled_from(["random", "mutated", "truncated", "empty", "header-only"]),
        st.binary(max_size=200),
        st.sampled_from([0o600, 0o644, 0o400, 0o000, 0o620, 0o666]),
    ),
    max_size=5,
)


@FUZZ
@given(files=garbage_files, special=st.sets(st.sampled_from(["dir", "fifo", "socket", "links"])))
def test_directory_of_garbage_around_a_live_writer(
    tmp_path_factory: pytest.TempPathFactory, files: list[tuple[str, bytes, int]], special: set[str]
) -> None:
    directory = tmp_path_factory.mktemp("rings")
    base = valid_ring_bytes(tmp_path_factory.mktemp("src"), records=5)
    for n, (kind, garbage, mode) in enumerate(files):
        if kind == "random":
            data = garbage
        elif kind == "mutated":
            raw = bytearray(base)
            for i in range(0, len(garbage) - 1, 2):
                raw[(garbage[i] * 97) % len(raw)] = garbage[i + 1]
            data = bytes(raw)
        elif kind == "truncated":
            data = base[: len(garbage) * 7 % len(base)]
        elif kind == "header-only":
            data = base[:HEADER_SIZE] + garbage
        else:
            data = b""
        write_file(directory / f"ring-g{n}.bin", data, mode)
    with contextlib.ExitStack() as stack:
        if "dir" in special:
            (directory / "ring-dir.bin").mkdir()
        if "fifo" in special:
            os.mkfifo(directory / "ring-fifo.bin")
        if "socket" in special:
            stack.enter_context(unix_socket(directory / "ring-sock.bin"))
        if "links" in special:
            (directory / "ring-dangling.bin").symlink_to(directory / "nowhere")
            write_file(directory / "target", base)
            (directory / "ring-link.bin").symlink_to(directory / "target")
        writer = stack.enter_context(
            RingWriter.create(
                directory, writer_id="live", hidden_size=HIDDEN, model="m", slot_count=4
            )
        )
        live = [publish(writer, i) for i in range(3)]
        rings = stack.enter_context(RingDirectory(directory))
        assert rings.has_ring()
        assert rings.publish_count() == 3  # dead and refused rings do not count
        assert rings.min_slot_count() == 4
        assert rings.hidden_size() == HIDDEN
        for key in live:
            found = rings.lookup(key)
            assert found is not None and found.key == key
        for key in [*KEYS, key_for(100), key_for(104), bytes(REQUEST_KEY_BYTES), b"short"]:
            found = rings.lookup(key)
            assert found is None or found.key == key
        # Change everything under it (files replaced, removed, truncated), then ask again.
        for n, (_, garbage, _) in enumerate(files):
            path = directory / f"ring-g{n}.bin"
            if n % 3 == 0:
                path.unlink()
            elif n % 3 == 1:
                write_file(path, garbage + base[len(garbage) :])
            elif path.stat().st_size > HEADER_SIZE:
                os.truncate(path, HEADER_SIZE)  # shrinks a mapping of a dead ring
        rings.refresh()
        assert rings.has_ring()
        assert rings.publish_count() == 3
        for key in live:
            found = rings.lookup(key)
            assert found is not None and found.key == key
        for key in [*KEYS, key_for(100), key_for(104)]:
            found = rings.lookup(key)
            assert found is None or found.key == key


def test_garbage_only_directory_never_raises(tmp_path: Path) -> None:
    """No live ring at all: every answer is 'nothing', none is an exception."""
    directory = tmp_path / "rings"
    directory.mkdir()
    write_file(directory / "ring-a.bin", os.urandom(4096))
    write_file(directory / "ring-b.bin", MAGIC + struct.pack("<I", LAYOUT_VERSION) + bytes(52))
    os.mkfifo(directory / "ring-c.bin")
    with RingDirectory(directory) as rings:
        assert not rings.has_ring()
        assert rings.lookup(KEYS[0]) is None
        assert rings.publish_count() == 0
        assert rings.min_slot_count() is None
        assert rings.hidden_size() is None
    with RingDirectory(tmp_path / "missing") as rings, RingDirectory(directory / "ring-a.bin") as f:
        for source in (rings, f):  # no such directory; a file where the directory should be
            assert not source.has_ring() and source.lookup(KEYS[0]) is None


def test_huge_sparse_ring_is_mapped_not_read(tmp_path: Path) -> None:
    """A consistent header describing a 4 GiB ring: opened lazily, looked up without reading
    it all (the reader touches only the index and the slot a key points to)."""
    slot_count, slot_size = 1 << 20, 1 << 12
    path = tmp_path / "ring-huge.bin"
    header = bytearray(HEADER_SIZE)
    struct.pack_into(
        HEADER_FMT, header, 0, MAGIC, LAYOUT_VERSION, HEADER_SIZE, slot_size, slot_count,
        REQUEST_KEY_BYTES, HIDDEN, 1, 1, 0, 0, 0,
    )  # fmt: skip
    with open(path, "wb") as f:
        f.write(header)
        try:
            f.truncate(slots_offset(slot_count) + slot_count * slot_size)
        except OSError as exc:
            pytest.skip(f"no sparse 4 GiB file here: {exc}")
    os.chmod(path, 0o600)
    try:
        reader = RingReader.open(path)
    except RingFormatError as exc:
        pytest.skip(f"cannot map 4 GiB here: {exc}")
    with reader:
        assert reader.lookup(KEYS[0]) is None
        assert reader.publish_count == 0
