"""The ring's byte ruler (ring/layout.py): constants, header validation, record coding.

The header test reads the file with offsets and formats written out here, from the ruler in
the module docstring, not with the module's constants: a constant that drifts from the
documented layout fails it.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import pytest

from tests.ring.helpers import (
    HIDDEN,
    MODEL,
    key_for,
    make_writer,
    publish_index,
    ready_header,
    record_of,
    shape_for,
    subprocess_env,
    vectors_for,
)
from vllm_hidden_state_proxy.ring import layout
from vllm_hidden_state_proxy.ring.layout import (
    KEY_BYTES,
    LAYOUT_VERSION,
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_NUM_HIDDEN_LAYERS,
    MAX_SLOT_COUNT,
    SLOT_HEADER_SIZE,
    LayoutError,
    RingFormatError,
    RingShape,
    align,
    check_layers,
    check_layout,
    decode_payload,
    fixed_header_fields,
    parse_header,
    runner_field,
    slot_size_for,
)
from vllm_hidden_state_proxy.ring.records import (
    MAX_ERROR_CHARS,
    ErrorRecord,
    Record,
    pack_error,
    pack_record,
)

# ---------------------------------------------------------------------------------------------
# the constants agree with each other, checked by code that python -O keeps
# ---------------------------------------------------------------------------------------------


def test_the_layout_constants_agree() -> None:
    check_layout()
    assert layout.FIXED_HEADER.size == layout.FIXED_HEADER_SIZE == 136
    assert layout.SLOT_META.size + layout.SLOT_KEY_OFFSET == layout.SLOT_PAYLOAD_OFFSET == 32


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("HDR_ENGINE_OFFSET", 45, "does not end at"),
        ("SLOT_LEN_OFFSET", 28, "does not end at"),
        ("FIXED_HEADER", struct.Struct("<8sIIIIIIQIIQQII"), "fixed header packs"),
        ("SLOT_META", struct.Struct(f"<{KEY_BYTES}sI"), "do not end at the payload"),
    ],
)
def test_a_constant_that_drifts_is_a_layout_error(
    monkeypatch: pytest.MonkeyPatch, name: str, value: object, message: str
) -> None:
    monkeypatch.setattr(layout, name, value)
    with pytest.raises(LayoutError, match=message):
        check_layout()


def test_the_layout_proof_survives_python_dash_o() -> None:
    """An ``assert`` would vanish under ``-O``; the proof must still refuse a bad layout."""
    script = (
        "from vllm_hidden_state_proxy.ring import layout\n"
        "layout.HDR_PUBLISH_COUNT_OFFSET = 52\n"
        "try:\n"
        "    layout.check_layout()\n"
        "except layout.LayoutError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:")


# ---------------------------------------------------------------------------------------------
# the shape's derived sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer_count", "header_size"),
    [(1, 192), (14, 192), (15, 256), (30, 256), (31, 320), (MAX_LAYERS, 4288)],
)
def test_header_size_grows_with_the_captured_layers(layer_count: int, header_size: int) -> None:
    shape = RingShape(3, 256, HIDDEN, MAX_NUM_HIDDEN_LAYERS, tuple(range(layer_count)))
    assert shape.header_size == header_size == align(136 + 4 * layer_count)
    assert shape.index_offset == header_size
    assert shape.index_end == header_size + 3 * KEY_BYTES
    assert shape.slots_offset == align(shape.index_end)
    assert shape.slots_offset % 64 == 0
    assert shape.file_size == shape.slots_offset + 3 * 256
    assert shape.payload_capacity == 256 - 32


def test_align() -> None:
    assert [align(n) for n in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert align(5, 8) == 8


# ---------------------------------------------------------------------------------------------
# the bytes on disk, against the documented ruler
# ---------------------------------------------------------------------------------------------


def test_header_and_slot_bytes_match_the_ruler(tmp_path: Path) -> None:
    writer = make_writer(
        tmp_path,
        instance=0x0123456789ABCDEF,
        engine=3,
        num_hidden_layers=12,
        layers=(12, 0, 4),
        slot_count=5,
        runner="vLLM 9.9 V1 TestRunner",
    )
    key = publish_index(writer, 0, layers=(4, 12), pooling="mean")
    data = writer.path.read_bytes()
    writer.close()

    def u32(offset: int) -> int:
        value: int = struct.unpack_from("<I", data, offset)[0]
        return value

    def u64(offset: int) -> int:
        value: int = struct.unpack_from("<Q", data, offset)[0]
        return value

    assert data[0:8] == b"VHSRING\x00"
    assert u32(8) == LAYOUT_VERSION == 4
    header_size = u32(12)
    assert header_size == 192  # align64(136 + 4 * 3)
    slot_size = u32(16)
    assert slot_size % 64 == 0 and slot_size == slot_size_for(HIDDEN, 3, MODEL)
    assert u32(20) == 5
    assert u32(24) == 16
    assert u32(28) == HIDDEN
    assert u64(32) == writer.epoch != 0
    assert u32(40) == writer.header.writer_pid
    assert u32(44) == 3
    assert u64(48) == 1  # publish counter
    assert u64(56) == 0x0123456789ABCDEF
    assert u32(64) == 12
    assert u32(68) == 3
    assert data[72:120] == b"vLLM 9.9 V1 TestRunner".ljust(48, b"\x00")
    assert (u64(120), u64(128)) == (0, 0)  # no arena
    assert struct.unpack_from("<3I", data, 136) == (0, 4, 12)  # ascending
    assert data[148:header_size] == bytes(header_size - 148)

    index = header_size
    assert data[index : index + 16] == key
    assert data[index + 16 : index + 5 * 16] == bytes(4 * 16)  # empty entries are zeros
    slots = align(index + 5 * 16)
    assert len(data) == slots + 5 * slot_size

    assert u64(slots) == 2  # seqlock: odd while written, even after one write
    assert data[slots + 8 : slots + 24] == key
    length, crc = u32(slots + 24), u32(slots + 28)
    payload = data[slots + 32 : slots + 32 + length]
    assert crc == zlib.crc32(payload)
    assert msgpack.unpackb(payload) == {
        "key": key,
        "model": MODEL,
        "position": 0,
        "num_prompt_tokens": 1,
        "pooling": "mean",
        "layers": [4, 12],
        "vectors": vectors_for(key, HIDDEN, (4, 12)),
    }
    assert data[slots + 32 + length : slots + slot_size] == bytes(slot_size - 32 - length)


# ---------------------------------------------------------------------------------------------
# header validation: parse_header names the first problem
# ---------------------------------------------------------------------------------------------


def with_u32(raw: bytes, offset: int, value: int) -> bytes:
    changed = bytearray(raw)
    struct.pack_into("<I", changed, offset, value)
    return bytes(changed)


GOOD_SHAPE = shape_for(slot_count=4, layers=(0, 1), num_hidden_layers=1)
GOOD = ready_header(GOOD_SHAPE)
SIZE = GOOD_SHAPE.file_size


def test_a_good_header_parses() -> None:
    header = parse_header(GOOD, SIZE)
    assert header.shape == GOOD_SHAPE
    assert (header.epoch, header.writer_pid, header.engine, header.instance) == (1, 1, 0, 7)
    assert fixed_header_fields(GOOD) == (192, 2)
    assert header.runner == ""


def test_the_runner_field_keeps_printable_ascii_and_is_cut_to_fit() -> None:
    assert runner_field("vLLM 0.33.0 V2 GPUModelRunner") == b"vLLM 0.33.0 V2 GPUModelRunner"
    assert runner_field("é\n" + "x" * 60) == b"??" + b"x" * 46


HEADER_PROBLEMS = {
    "bad-magic": (b"NOTRING\x00" + GOOD[8:], SIZE, "bad magic"),
    "not-ready": (with_u32(GOOD, 8, 0), SIZE, r"not ready \(layout version 0"),
    "empty": (b"", SIZE, r"truncated header \(0 of 136 bytes\)"),
    "truncated-fixed": (GOOD[:40], SIZE, "truncated header"),
    "truncated-layers": (GOOD[:140], SIZE, r"truncated header \(140 of 192 bytes\)"),
    "runner-not-ascii": (GOOD[:72] + b"\x80" + GOOD[73:], SIZE, "runner field"),
    "key-size": (with_u32(GOOD, 24, 8), SIZE, "key size 8"),
    "slot-count-0": (with_u32(GOOD, 20, 0), SIZE, "slot count 0 out of range"),
    "slot-count-huge": (with_u32(GOOD, 20, MAX_SLOT_COUNT + 1), SIZE, "slot count"),
    "hidden-size-0": (with_u32(GOOD, 28, 0), SIZE, "hidden size 0 out of range"),
    "hidden-size-huge": (with_u32(GOOD, 28, MAX_HIDDEN_SIZE + 1), SIZE, "hidden size"),
    "layer-count-0": (with_u32(GOOD, 68, 0), SIZE, "captured layer count 0"),
    "layer-count-huge": (with_u32(GOOD, 68, MAX_LAYERS + 1), SIZE, "captured layer count"),
    "layer-count-disagrees": (with_u32(GOOD, 68, 15), SIZE, r"header size 192 \(expected 256\)"),
    "header-size": (with_u32(GOOD, 12, 64), SIZE, r"header size 64 \(expected 192\)"),
    "slot-size-odd": (with_u32(GOOD, 16, GOOD_SHAPE.slot_size + 1), SIZE, "slot size"),
    "slot-size-small": (with_u32(GOOD, 16, 64), SIZE, "need a multiple of 64"),
    "file-too-small": (GOOD, SIZE - 1, "bytes but the header describes"),
    "file-too-big": (GOOD, SIZE + 64, "bytes but the header describes"),
}


@pytest.mark.parametrize(
    ("raw", "file_size", "message"), list(HEADER_PROBLEMS.values()), ids=list(HEADER_PROBLEMS)
)
def test_header_problems_are_refused(raw: bytes, file_size: int, message: str) -> None:
    with pytest.raises(RingFormatError, match=message):
        parse_header(raw, file_size)


@pytest.mark.parametrize("version", [1, 2, 3, 0xFFFFFFFF])
def test_another_layout_version_names_different_releases(version: int) -> None:
    with pytest.raises(RingFormatError) as caught:
        parse_header(with_u32(GOOD, 8, version), SIZE)
    message = str(caught.value)
    assert f"unsupported layout version {version} (expected {LAYOUT_VERSION})" in message
    assert "different releases of vllm-hidden-state-proxy" in message


@pytest.mark.parametrize(
    ("layers", "num_hidden_layers"),
    [
        ((1, 0), 1),  # descending
        ((0, 0), 1),  # duplicate
        ((0, 2), 1),  # beyond N
        ((0, 1), 0),  # no decoder layers
        ((0, 1), MAX_NUM_HIDDEN_LAYERS + 1),
    ],
    ids=["descending", "duplicate", "beyond-n", "n-zero", "n-huge"],
)
def test_bad_layer_lists_are_refused(layers: tuple[int, int], num_hidden_layers: int) -> None:
    shape = RingShape(4, GOOD_SHAPE.slot_size, HIDDEN, num_hidden_layers, layers)
    with pytest.raises(RingFormatError, match="captured layers"):
        parse_header(ready_header(shape), shape.file_size)


@pytest.mark.parametrize(
    ("layers", "num_hidden_layers", "message"),
    [
        ((), 4, "between 1 and"),
        (tuple(range(MAX_LAYERS + 1)), MAX_NUM_HIDDEN_LAYERS, "between 1 and"),
        ((2, 1), 4, "ascending and unique"),
        ((1, 1), 4, "ascending and unique"),
        ((0, 5), 4, r"in \[0, 4\]"),
        ((-1,), 4, "ascending and unique"),
        ((0,), 0, "num_hidden_layers must be in"),
    ],
)
def test_check_layers(layers: tuple[int, ...], num_hidden_layers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_layers(layers, num_hidden_layers)
    check_layers((0, 4), 4)


# ---------------------------------------------------------------------------------------------
# slot sizes
# ---------------------------------------------------------------------------------------------


def test_slot_size_for_fits_the_largest_record_and_error() -> None:
    for hidden_size, layer_count in ((1, 1), (8, 1), (4096, 1), (4096, 3), (8192, 40)):
        size = slot_size_for(hidden_size, layer_count, MODEL)
        assert size % 64 == 0
        worst = Record(
            key=key_for(0),
            model=MODEL,
            position=(1 << 64) - 1,
            num_prompt_tokens=(1 << 64) - 1,
            pooling="mean",
            layers=(MAX_NUM_HIDDEN_LAYERS,) * layer_count,
            hidden_size=hidden_size,
            vectors=bytes(4 * hidden_size * layer_count),
        )
        assert SLOT_HEADER_SIZE + len(pack_record(worst)) <= size
        error = pack_error(key_for(0), "\U0010ffff" * (MAX_ERROR_CHARS + 5))
        assert SLOT_HEADER_SIZE + len(error) <= size
    assert slot_size_for(4096, 1, "m" * 200) > slot_size_for(4096, 1, "m")
    assert slot_size_for(4096, 2, MODEL) > slot_size_for(4096, 1, MODEL)


@pytest.mark.parametrize(
    ("hidden_size", "layer_count", "error"),
    [
        (0, 1, ValueError),
        (MAX_HIDDEN_SIZE + 1, 1, ValueError),
        (8, 0, ValueError),
        (8, MAX_LAYERS + 1, ValueError),
        (True, 1, TypeError),
        (8.0, 1, TypeError),
    ],
)
def test_slot_size_for_refuses(hidden_size: object, layer_count: int, error: type) -> None:
    with pytest.raises(error):
        slot_size_for(hidden_size, layer_count, MODEL)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------

SHAPE = shape_for(layers=(0, 2, 4), num_hidden_layers=4)


def test_a_record_with_several_layers_gives_each_layer_its_vector() -> None:
    values = {layer: [float(layer) + j / 4 for j in range(HIDDEN)] for layer in (4, 0)}
    vectors = b"".join(struct.pack(f"<{HIDDEN}f", *values[layer]) for layer in (4, 0))
    record = Record(key_for(1), MODEL, 6, 7, "mean", (4, 0), HIDDEN, vectors)
    assert record.vector(4) == vectors[: 4 * HIDDEN]
    assert record.vector(0) == vectors[4 * HIDDEN :]
    assert record.floats(4) == values[4]
    assert record.floats(0) == values[0]
    with pytest.raises(KeyError):
        record.vector(2)  # captured by the ring, but not in this record


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("layers", [(4,), (0, 2, 4), (4, 0)])
def test_records_round_trip(pooling: str, layers: tuple[int, ...]) -> None:
    record = record_of(9, layers=layers, pooling=pooling)
    decoded = decode_payload(msgpack.unpackb(pack_record(record)), record.key, SHAPE)
    assert decoded == record


def test_error_records_round_trip() -> None:
    key = key_for(3)
    decoded = decode_payload(msgpack.unpackb(pack_error(key, "out of memory")), key, SHAPE)
    assert decoded == ErrorRecord(key, "out of memory")


def test_error_messages_are_cut_and_kept_valid_utf8() -> None:
    key = key_for(3)
    long = pack_error(key, "é" * (MAX_ERROR_CHARS + 100))
    decoded = decode_payload(msgpack.unpackb(long), key, SHAPE)
    assert decoded == ErrorRecord(key, "é" * MAX_ERROR_CHARS)
    lone = pack_error(key, "bad \udc80 surrogate")
    decoded = decode_payload(msgpack.unpackb(lone, raw=False), key, SHAPE)
    assert decoded == ErrorRecord(key, "bad ? surrogate")


GOOD_PAYLOAD: dict[str, object] = {
    "key": key_for(1),
    "model": MODEL,
    "position": 1,
    "num_prompt_tokens": 2,
    "pooling": "last",
    "layers": [4],
    "vectors": bytes(4 * HIDDEN),
}

PAYLOAD_PROBLEMS: dict[str, dict[str, object]] = {
    "other-key": {"key": key_for(2)},
    "key-not-bytes": {"key": list(key_for(1))},
    "layer-not-captured": {"layers": [3]},
    "no-layers": {"layers": [], "vectors": b""},
    "duplicate-layers": {"layers": [4, 4], "vectors": bytes(8 * HIDDEN)},
    "layers-not-a-list": {"layers": 4},
    "layer-bool": {"layers": [True]},
    "vectors-short": {"vectors": bytes(4 * HIDDEN - 1)},
    "vectors-for-two-layers": {"vectors": bytes(8 * HIDDEN)},
    "vectors-not-bytes": {"vectors": "x" * 4 * HIDDEN},
    "position-bool": {"position": True},
    "position-float": {"position": 1.0},
    "tokens-missing": {"num_prompt_tokens": None},
    "pooling-unknown": {"pooling": "max"},
    "model-not-str": {"model": b"m"},
    "error-not-str": {"error": 5},
}


@pytest.mark.parametrize("change", list(PAYLOAD_PROBLEMS.values()), ids=list(PAYLOAD_PROBLEMS))
def test_payloads_that_are_not_exactly_one_record_are_none(change: dict[str, object]) -> None:
    assert decode_payload(GOOD_PAYLOAD, key_for(1), SHAPE) is not None
    payload = {k: v for k, v in {**GOOD_PAYLOAD, **change}.items() if v is not None}
    assert decode_payload(payload, key_for(1), SHAPE) is None


@pytest.mark.parametrize("value", [None, 5, [GOOD_PAYLOAD], "x", b"x"])
def test_payloads_that_are_not_maps_are_none(value: object) -> None:
    assert decode_payload(value, key_for(1), SHAPE) is None
