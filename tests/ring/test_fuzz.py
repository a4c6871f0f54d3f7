"""Hostile rings: the proxy's side never trusts what it maps (hypothesis).

- arbitrary and mutated bytes: ``RingReader.open`` raises ``RingFormatError`` or opens a ring
  whose lookups return the requested key's record or nothing;
- hand-forged rings (a valid header, then anything, with correct CRCs over arbitrary msgpack):
  ``lookup`` returns exactly what the rules below say, never another key's record;
- the key map against a model: any sequence of publishes (keys repeated, error records, slot
  reuse) and lookups, by a reader that keeps up and by one that falls behind;
- a live ring scribbled over in place while mapped: nothing raises, later records are found;
- a directory of garbage around one live writer: every answer is about the live ring.
"""

from __future__ import annotations

import contextlib
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

from tests.ring.helpers import (
    assert_is_record_of,
    key_for,
    make_writer,
    publish_index,
    ready_header,
    valid_ring_bytes,
    vectors_for,
    write_file,
)
from vllm_hidden_state_proxy.ring import (
    ErrorRecord,
    Found,
    Record,
    RingDirectory,
    RingFormatError,
    RingReader,
    RingWriter,
)
from vllm_hidden_state_proxy.ring.layout import (
    HDR_PUBLISH_COUNT_OFFSET,
    KEY_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    RingShape,
    slot_size_for,
)

HIDDEN = 4
LAYERS = (0, 2)  # captured by the forged rings, of N = 2
SLOT_HEADER = 32  # seq u64, key 16, length u32, crc u32 (layout.py's ruler)
KEYS = [key_for(i) for i in range(4)]
NAME = "ring-00000000000000ff-dp0.bin"

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def fresh_directory(tmp_path: Path) -> Path:
    """A new directory per hypothesis example (the fixture's tmp_path is shared by all)."""
    directory = tmp_path / os.urandom(6).hex()
    directory.mkdir()
    return directory


# ---------------------------------------------------------------------------------------------
# arbitrary and mutated bytes
# ---------------------------------------------------------------------------------------------

any_keys = st.lists(
    st.one_of(
        st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),
        st.binary(max_size=24),
        st.integers(0, 5).map(key_for),
    ),
    max_size=6,
)


def check_garbage_file(directory: Path, data: bytes, keys: list[bytes]) -> None:
    path = directory / NAME
    write_file(path, data)
    try:
        reader: RingReader | None = RingReader.open(path)
    except RingFormatError:
        reader = None
    if reader is not None:
        with reader:
            for key in keys:
                found = reader.lookup(key)
                assert found is None or found.key == key
                if isinstance(found, Record):
                    assert len(found.vectors) == 4 * found.hidden_size * len(found.layers)
    with RingDirectory(directory) as rings:
        for key in keys:
            found = rings.lookup(key)
            assert found is None or found.key == key
        rings.failed_engines()
        rings.publish_marks()


@FUZZ
@given(data=st.binary(max_size=2048), keys=any_keys)
def test_arbitrary_bytes(tmp_path: Path, data: bytes, keys: list[bytes]) -> None:
    directory = fresh_directory(tmp_path)
    check_garbage_file(directory, data, keys)
    # The same bytes behind a valid magic and version, so that the deeper checks are reached.
    check_garbage_file(directory, MAGIC + struct.pack("<I", LAYOUT_VERSION) + data, keys)


_BASE: dict[str, bytes] = {}


def valid_base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A 4-slot ring holding records 2..5 (6 published)."""
    if "base" not in _BASE:
        _BASE["base"] = valid_ring_bytes(tmp_path_factory.mktemp("base"), records=6)
    return _BASE["base"]


def test_the_mutation_base_is_a_readable_ring(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Mutating it is not vacuous: unmutated, it opens and holds records."""
    write_file(tmp_path / NAME, valid_base(tmp_path_factory))
    with RingReader.open(tmp_path / NAME) as reader:
        assert reader.lookup(key_for(1)) is None  # overwritten
        for i in range(2, 6):
            assert_is_record_of(reader.lookup(key_for(i)), i)


@FUZZ
@given(
    mutations=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8),
    header_words=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 0xFFFFFFFF)), max_size=2),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
    keys=any_keys,
)
def test_mutated_valid_rings(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    mutations: list[tuple[int, int]],
    header_words: list[tuple[int, int]],
    cut: int | None,
    keys: list[bytes],
) -> None:
    data = bytearray(valid_base(tmp_path_factory))
    for position, value in mutations:
        data[position % len(data)] = value
    for word, value in header_words:
        struct.pack_into("<I", data, 4 * word, value)
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    check_garbage_file(fresh_directory(tmp_path), bytes(data), [*keys, key_for(3)])


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
    layer_lists = st.sampled_from([[0], [2], [2, 0], [0, 2]])
    return st.fixed_dictionaries(
        {
            "key": mostly(st.just(key), st.sampled_from(KEYS)),
            "model": mostly(st.text(max_size=4), msgpack_values),
            "position": mostly(st.integers(-(1 << 63), (1 << 64) - 1), msgpack_values),
            "num_prompt_tokens": mostly(st.integers(0, 1 << 20), msgpack_values),
            "pooling": mostly(st.sampled_from(["last", "mean"]), msgpack_values),
            "layers": mostly(
                layer_lists, st.sampled_from([[], [1], [0, 0], [True], "0", [2, 0, 2]])
            ),
            "vectors": mostly(
                st.sampled_from([4 * HIDDEN, 8 * HIDDEN]).flatmap(
                    lambda n: st.binary(min_size=n, max_size=n)
                ),
                msgpack_values,
            ),
        },
        optional={"extra": msgpack_values, "error": mostly(st.text(max_size=5), msgpack_values)},
    )


@st.composite
def payloads(draw: st.DrawFn, key: bytes) -> bytes:
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "error", "record", "record", "value", "bytes", "ext", "trailing"]
        )
    )
    if kind == "valid":
        layers = draw(st.sampled_from([[0], [2], [2, 0]]))
        record = {
            "key": key,
            "model": "m",
            "position": 1,
            "num_prompt_tokens": 2,
            "pooling": "last",
            "layers": layers,
            "vectors": draw(st.binary(min_size=4 * HIDDEN, max_size=4 * HIDDEN)) * len(layers),
        }
        return bytes(msgpack.packb(record, use_bin_type=True))
    if kind == "error":
        error = {"key": key, "error": draw(st.text(max_size=8))}
        return bytes(msgpack.packb(error, use_bin_type=True))
    if kind == "record":
        return bytes(msgpack.packb(draw(near_records(key)), use_bin_type=True))
    if kind == "value":
        return bytes(msgpack.packb(draw(msgpack_values), use_bin_type=True))
    if kind == "ext":
        ext = msgpack.ExtType(draw(st.integers(0, 127)), draw(st.binary(max_size=12)))
        return bytes(msgpack.packb({"key": key, "vectors": ext}, use_bin_type=True))
    if kind == "trailing":
        return bytes(msgpack.packb({"key": key}, use_bin_type=True)) + draw(st.binary(max_size=4))
    return draw(st.binary(max_size=60))


@st.composite
def slots(draw: st.DrawFn, key: bytes) -> dict[str, Any]:
    payload = draw(payloads(key))
    return {
        "seq": draw(mostly(st.sampled_from([0, 2, (1 << 64) - 2]), st.sampled_from([1, 3]))),
        "key": draw(mostly(st.just(key), st.sampled_from([*KEYS, bytes(KEY_BYTES)]))),
        "payload": payload,
        "length": draw(mostly(st.just(len(payload)), st.integers(0, (1 << 32) - 1))),
        "crc": draw(mostly(st.none(), st.integers(0, (1 << 32) - 1))),
    }


def build_ring(
    shape: RingShape, published: int, index: list[bytes], slot_list: list[dict[str, Any]]
) -> bytes:
    """A ring file laid out by hand from the documented ruler (not through RingWriter)."""
    data = bytearray(shape.file_size)
    data[: shape.header_size] = ready_header(shape)
    struct.pack_into("<Q", data, HDR_PUBLISH_COUNT_OFFSET, published)
    for i, entry in enumerate(index):
        data[shape.index_offset + KEY_BYTES * i : shape.index_offset + KEY_BYTES * (i + 1)] = entry
    capacity = shape.slot_size - SLOT_HEADER
    for i, slot in enumerate(slot_list):
        at = shape.slots_offset + i * shape.slot_size
        payload = slot["payload"][:capacity]
        crc = zlib.crc32(payload) if slot["crc"] is None else slot["crc"]
        struct.pack_into("<Q16sII", data, at, slot["seq"], slot["key"], slot["length"], crc)
        data[at + SLOT_HEADER : at + SLOT_HEADER + len(payload)] = payload
    return bytes(data)


def expected_record(obj: Any, key: bytes) -> Found | None:
    """The rules of a payload, stated independently of layout.decode_payload."""
    if type(obj) is not dict or type(obj.get("key")) is not bytes or obj["key"] != key:
        return None
    if "error" in obj:
        return ErrorRecord(key, obj["error"]) if type(obj["error"]) is str else None
    layers = obj.get("layers")
    if type(layers) is not list or not layers or len(set(layers)) != len(layers):
        return None
    if not all(type(layer) is int and layer in LAYERS for layer in layers):
        return None
    kinds = {"model": str, "position": int, "num_prompt_tokens": int, "vectors": bytes}
    if any(type(obj.get(name)) is not kind for name, kind in kinds.items()):
        return None
    if obj.get("pooling") not in ("last", "mean") or len(obj["vectors"]) != 4 * HIDDEN * len(
        layers
    ):
        return None
    return Record(
        key,
        obj["model"],
        obj["position"],
        obj["num_prompt_tokens"],
        obj["pooling"],
        tuple(layers),
        HIDDEN,
        obj["vectors"],
    )


def record_in_slot(data: bytes, shape: RingShape, slot: int, key: bytes) -> Found | None:
    at = shape.slots_offset + slot * shape.slot_size
    seq, slot_key, length, crc = struct.unpack_from("<Q16sII", data, at)
    if seq & 1 or slot_key != key or length > shape.slot_size - SLOT_HEADER:
        return None
    payload = data[at + SLOT_HEADER : at + SLOT_HEADER + length]
    if zlib.crc32(payload) != crc:
        return None
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    return expected_record(obj, key)


def expected_lookup(data: bytes, shape: RingShape, published: int, key: bytes) -> Found | None:
    """A new reader reads the index entries of the last ``min(published, N)`` publishes, in
    publish order; a key's newest entry decides, and only that slot is read."""
    n = shape.slot_count
    first = published - n if published >= n else 0
    newest = None
    for count in range(first, published):
        slot = count % n
        at = shape.index_offset + KEY_BYTES * slot
        if data[at : at + KEY_BYTES] == key:
            newest = slot
    return None if newest is None else record_in_slot(data, shape, newest, key)


@st.composite
def forged_rings(draw: st.DrawFn) -> tuple[RingShape, int, bytes]:
    slot_count = draw(st.integers(1, 4))
    slot_size = slot_size_for(HIDDEN, len(LAYERS), "") + 64 * draw(st.integers(0, 1))
    shape = RingShape(slot_count, slot_size, HIDDEN, 2, LAYERS)
    published = draw(st.one_of(st.integers(0, 2 * slot_count), st.just((1 << 64) - 1)))
    target = draw(st.sampled_from(KEYS))
    entries = st.one_of(st.sampled_from(KEYS), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
    index = draw(
        st.lists(mostly(st.just(target), entries), min_size=slot_count, max_size=slot_count)
    )
    slot_list = draw(st.lists(slots(target), min_size=slot_count, max_size=slot_count))
    return shape, published, build_ring(shape, published, index, slot_list)


@settings(FUZZ, max_examples=500)
@given(
    ring=forged_rings(),
    flips=st.lists(st.tuples(st.integers(0), st.integers(0, 255)), max_size=3),
)
def test_forged_rings_give_exactly_the_valid_record_or_none(
    tmp_path: Path, ring: tuple[RingShape, int, bytes], flips: list[tuple[int, int]]
) -> None:
    shape, published, data = ring
    raw = bytearray(data)
    for position, value in flips:  # past the header, so that the file still opens
        raw[shape.header_size + position % (len(raw) - shape.header_size)] = value
    data = bytes(raw)
    path = fresh_directory(tmp_path) / NAME
    write_file(path, data)
    with RingReader.open(path) as reader:
        assert reader.shape == shape
        for key in KEYS:
            expected = expected_lookup(data, shape, published, key)
            found = reader.lookup(key)
            event(type(found).__name__)
            assert found == expected
            assert reader.lookup(key) == expected  # the same on a second look


# ---------------------------------------------------------------------------------------------
# the key map against a model
# ---------------------------------------------------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(0, 7), st.sampled_from([(1,), (0,), (1, 0)])),
        st.tuples(st.just("error"), st.integers(0, 7), st.just(())),
        st.tuples(st.just("lookup"), st.integers(0, 7), st.just(())),
    ),
    max_size=40,
)


@FUZZ
@given(slot_count=st.integers(1, 5), ops=operations)
def test_the_key_map_agrees_with_a_model(
    tmp_path: Path, slot_count: int, ops: list[tuple[str, int, tuple[int, ...]]]
) -> None:
    """The newest publication of a key among the last N is what a lookup returns, whether
    the reader looked after every publish, only now and then, or opens only at the end."""
    history: list[Found] = []

    def expected(key: bytes) -> Found | None:
        for found in reversed(history[-slot_count:]):
            if found.key == key:
                return found
        return None

    directory = fresh_directory(tmp_path)
    with (
        make_writer(directory, slot_count=slot_count, num_hidden_layers=1, layers=(0, 1)) as writer,
        RingReader.open(writer.path) as eager,
        RingReader.open(writer.path) as lazy,
    ):
        for step, (op, number, layers) in enumerate(ops):
            key = key_for(number)
            if op == "publish":
                vectors = vectors_for(key, writer.hidden_size, layers)
                writer.publish(
                    key, vectors, position=step, num_prompt_tokens=step + 1, layers=layers
                )
                history.append(
                    Record(key, writer.model, step, step + 1, "last", layers, 8, vectors)
                )
            elif op == "error":
                writer.publish_error(key, f"error {step}")
                history.append(ErrorRecord(key, f"error {step}"))
            else:
                assert lazy.lookup(key) == expected(key)
            for number_ in range(8):
                assert eager.lookup(key_for(number_)) == expected(key_for(number_))
        with RingReader.open(writer.path) as late:
            for number_ in range(8):
                assert late.lookup(key_for(number_)) == expected(key_for(number_))
                assert lazy.lookup(key_for(number_)) == expected(key_for(number_))


# ---------------------------------------------------------------------------------------------
# a live ring scribbled over while mapped
# ---------------------------------------------------------------------------------------------


def publish(writer: RingWriter, i: int) -> bytes:
    return publish_index(writer, i)


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
    directory = fresh_directory(tmp_path)
    with make_writer(directory) as writer, RingDirectory(directory) as rings:
        before = [publish(writer, i) for i in range(published)]
        counter_hit = False
        with RingReader.open(writer.path) as reader:
            for found in (reader.lookup(k) for k in before[-4:]):  # the map is built first
                assert found is not None
            with open(writer.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as scribble:
                for position, garbage in writes:
                    at = position % len(scribble)
                    chunk = garbage[: len(scribble) - at]
                    scribble[at : at + len(chunk)] = chunk
                    end = HDR_PUBLISH_COUNT_OFFSET + 8
                    counter_hit |= at < end and at + len(chunk) > HDR_PUBLISH_COUNT_OFFSET
                for key in [*before, *KEYS, key_for(99)]:
                    for found in (reader.lookup(key), rings.lookup(key)):
                        assert found is None or found.key == key
                        event("old record kept" if found is not None else "old record gone")
                assert rings.has_ring()
                assert rings.live_ring_count() == 1
                assert rings.smallest_slot_count() == 4
                assert [shape.hidden_size for shape in rings.live_shapes()] == [8]
                rings.publish_marks()
                # Whatever was scribbled, a record published afterwards is found intact, unless
                # the scribble forged the very publish count the reader then sees: that costs
                # at most the records up to the next wrap-around, never a wrong one.
                fresh = publish(writer, 1000)
                for found in (reader.lookup(fresh), rings.lookup(fresh)):
                    if counter_hit and found is None:
                        event("publish count forged: record missed")
                        continue
                    assert_is_record_of(found, 1000)


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


garbage_files = st.lists(
    st.tuples(
        st.sampled_from(["random", "mutated", "truncated", "empty", "header-only", "note"]),
        st.binary(max_size=200),
        st.sampled_from([0o600, 0o644, 0o400, 0o000, 0o620, 0o666]),
    ),
    max_size=5,
)


@FUZZ
@given(files=garbage_files, special=st.sets(st.sampled_from(["dir", "fifo", "socket", "links"])))
def test_a_directory_of_garbage_around_a_live_writer(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    files: list[tuple[str, bytes, int]],
    special: set[str],
) -> None:
    directory = fresh_directory(tmp_path)
    base = valid_base(tmp_path_factory)
    with contextlib.ExitStack() as stack:
        # The writer first: a new writer sweeps unlocked files away.
        writer = stack.enter_context(make_writer(directory, instance=0x11))
        live = [publish(writer, i) for i in range(3)]
        names = []
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
                data = base[:128] + garbage
            elif kind == "note":
                data = garbage
            else:
                data = b""
            suffix = "failed" if kind == "note" else "bin"
            names.append(f"ring-{0x1000 + n:016x}-dp{n}.{suffix}")
            write_file(directory / names[-1], data, mode)
        if "dir" in special:
            (directory / "ring-0000000000002000-dp0.bin").mkdir()
        if "fifo" in special:
            os.mkfifo(directory / "ring-0000000000002001-dp0.bin")
        if "socket" in special:
            stack.enter_context(unix_socket(directory / "ring-0000000000002002-dp0.bin"))
        if "links" in special:
            (directory / "ring-0000000000002003-dp0.bin").symlink_to(directory / "nowhere")
            write_file(directory / "target", base)
            (directory / "ring-0000000000002004-dp0.bin").symlink_to(directory / "target")
        rings = stack.enter_context(RingDirectory(directory))

        def serves_the_live_ring() -> None:
            assert rings.has_ring()
            assert rings.live_ring_count() == 1
            assert list(rings.publish_marks().values()) == [3]  # dead, refused rings: none
            assert rings.smallest_slot_count() == 4
            assert rings.publishing_instances() == frozenset({0x11})
            assert rings.failed_engines() == ()  # garbage notes are not live
            for key in live:
                found = rings.lookup(key)
                assert found is not None and found.key == key
            for key in [*KEYS, key_for(100), bytes(KEY_BYTES), b"short"]:
                found = rings.lookup(key)
                assert found is None or found.key == key

        serves_the_live_ring()
        # Change everything under it (files replaced, removed, truncated), then ask again.
        for n, ((_, garbage, _), name) in enumerate(zip(files, names, strict=True)):
            path = directory / name
            if n % 3 == 0:
                path.unlink()
            elif n % 3 == 1:
                write_file(path, garbage + base[len(garbage) :])
            elif path.stat().st_size > 128:
                os.truncate(path, 128)  # shrinks a mapping of a dead ring (not below its header)
        rings.refresh()
        serves_the_live_ring()


def test_a_directory_of_garbage_only_answers_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "rings"
    directory.mkdir()
    write_file(directory / "ring-000000000000000a-dp0.bin", os.urandom(4096))
    write_file(
        directory / "ring-000000000000000b-dp0.bin",
        MAGIC + struct.pack("<I", LAYOUT_VERSION) + bytes(136),
    )
    write_file(directory / "ring-000000000000000c-dp0.failed", b'{"engine": 0}')
    os.mkfifo(directory / "ring-000000000000000d-dp0.bin")
    with RingDirectory(directory) as rings:
        assert not rings.has_ring()
        assert rings.lookup(KEYS[0]) is None
        assert rings.live_ring_count() == 0
        assert rings.publish_marks() == {}
        assert rings.smallest_slot_count() is None
        assert rings.live_shapes() == ()
        assert rings.failed_engines() == ()
