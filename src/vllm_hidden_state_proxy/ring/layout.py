"""The ring file's layout: the byte ruler, its constants, header validation and record coding.

File ``<directory>/ring-<instance>-dp<engine>.bin`` (one per engine), little-endian throughout
(N = slot count, Z = slot size, L = captured layer count, A = arena size)::

    offset                                                   constants (offset / struct format)
         0 +-----------------------------------------------+
           | magic  b"VHSRING\\0"                  8 bytes | HDR_MAGIC_OFFSET / HDR_MAGIC_FMT
         8 | layout version u32  (*)                       | HDR_VERSION_OFFSET / ..._FMT
        12 | header size u32 (H)                           | HDR_HEADER_SIZE_OFFSET / ..._FMT
        16 | slot size u32 (Z, multiple of 64)             | HDR_SLOT_SIZE_OFFSET / ..._FMT
        20 | slot count u32 (N)                            | HDR_SLOT_COUNT_OFFSET / ..._FMT
        24 | key size u32 (= 16)                           | HDR_KEY_SIZE_OFFSET / ..._FMT
        28 | hidden size u32                               | HDR_HIDDEN_SIZE_OFFSET / ..._FMT
        32 | writer epoch u64 (random, new per file)       | HDR_EPOCH_OFFSET / ..._FMT
        40 | writer pid u32                                | HDR_WRITER_PID_OFFSET / ..._FMT
        44 | engine u32 (vLLM's data_parallel_index)       | HDR_ENGINE_OFFSET / ..._FMT
        48 | publish counter u64 (records published)       | HDR_PUBLISH_COUNT_OFFSET / ..._FMT
        56 | instance u64 (same for one vLLM's engines)    | HDR_INSTANCE_OFFSET / ..._FMT
        64 | num hidden layers u32 (the model's N)         | HDR_NUM_LAYERS_OFFSET / ..._FMT
        68 | captured layer count u32 (L)                  | HDR_LAYER_COUNT_OFFSET / ..._FMT
        72 | runner: ASCII, NUL-padded            48 bytes | HDR_RUNNER_OFFSET / ..._FMT
           |   "vLLM <version> <V1|V2> <runner class>"     |
       120 | arena size u64 (A, multiple of 64; 0: none)   | HDR_ARENA_SIZE_OFFSET / ..._FMT
       128 | max record bytes u64 (a matrix's payload)     | HDR_MAX_RECORD_OFFSET / ..._FMT
       136 | captured layers u32 x L (ascending, 0..N)     | HDR_LAYERS_OFFSET / LAYER_FMT
           | zero padding up to H = align64(136 + 4 L)     |
         H +-----------------------------------------------+ index offset (= H)
           | request key of slot 0                16 bytes | INDEX_ENTRY_SIZE (= KEY_BYTES)
           | request key of slot 1  (all zeros when empty) |
           | ...                                           |
           | request key of slot N-1                       |
           +-----------------------------------------------+
           | zero padding up to a multiple of 64           |
         S +-----------------------------------------------+ S = align64(H + 16 * N)
           | slot 0                                        |
    S + Z  +-----------------------------------------------+
           | ...                                           |
  S + N*Z  +-----------------------------------------------+ = R (arena offset)
           | the arena: blocks, written round and round    |
  R + A    +-----------------------------------------------+ = file size

    (*) 0 while the file is being made; the writer stores LAYOUT_VERSION there last.

    one slot, at S + i * Z
        +0 +-----------------------------------------------+
           | seqlock counter u64, odd while being written  | SLOT_SEQ_OFFSET / SLOT_SEQ_FMT
        +8 | request key                          16 bytes | SLOT_KEY_OFFSET / SLOT_KEY_FMT
       +24 | payload length u32                            | SLOT_LEN_OFFSET / SLOT_LEN_FMT
       +28 | crc32 of the payload u32 (zlib.crc32)         | SLOT_CRC_OFFSET / SLOT_CRC_FMT
       +32 +-----------------------------------------------+ SLOT_PAYLOAD_OFFSET
           | msgpack map, a record:                        |
           |   "key": bytes (16)     "model": str          |
           |   "position": int       "num_prompt_tokens": int
           |   "pooling": one of protocol.POOLINGS         |
           |   "layers": [int] (a subset of the captured)  |
           |   "vectors": bytes (LE f32, layer after layer)|
           | or a matrix record (pooling all_prompt,       |
           | all_answer): the same without "vectors", and  |
           |   "rows": int (R >= 1, positions per layer)   |
           |   "arena": [offset, length, crc32, seq]: its  |
           |     block (LE f32 [L, R, hidden], layer after |
           |     layer, position after position)           |
           | or an error record:                           |
           |   "key": bytes (16)     "error": str          |
           |   "status": int (the HTTP status it means)    |
           +-----------------------------------------------+
           | unused up to Z                                |
        +Z +-----------------------------------------------+

    one arena block, at R + offset (offset a multiple of 64)
        +0 +-----------------------------------------------+
           | seqlock counter u64: the record's seq, odd    | ARENA_SEQ_OFFSET / ARENA_SEQ_FMT
           |   while written or once written over          |
        +8 | request key                          16 bytes | ARENA_KEY_OFFSET / ARENA_KEY_FMT
       +24 | payload length u64                            | ARENA_LEN_OFFSET / ARENA_LEN_FMT
       +32 | crc32 of the payload u32 (zlib.crc32)         | ARENA_CRC_OFFSET / ARENA_CRC_FMT
       +36 | zero padding up to 64                         |
       +64 +-----------------------------------------------+ ARENA_PAYLOAD_OFFSET
           | payload: the matrix's float32 bytes           |
           +-----------------------------------------------+ up to a multiple of 64

The slot record is written after its block, so a reader that finds the slot finds the block
complete, unless newer blocks have been written over it since (the writer marks each block it
writes over odd first): the reader checks seq, key, length and CRC against the slot's record,
copies the payload, and checks the seq again. Any difference: the record was written over, an
error record to the proxy (503, naming the arena's size), never another request's rows.

A layer index ``k`` is Transformers' ``output_hidden_states`` index: 0 the embeddings, ``k`` the
residual stream after ``k`` decoder layers, ``N`` the final layer after the final norm.

Publishing, looking up, liveness: see :mod:`.writer`, :mod:`.reader` and :mod:`.directory`.
"""

from __future__ import annotations

import itertools
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden_state_proxy.protocol import MATRIX_POOLINGS, POOLINGS, REQUEST_KEY_BYTES

# The most layers a header may list: the bound every request is checked against too, so it
# lives with the other shared facts (re-exported here with the header's other limits).
from vllm_hidden_state_proxy.protocol import MAX_LAYERS as MAX_LAYERS
from vllm_hidden_state_proxy.ring.records import (
    ERROR_STATUSES,
    HOOK_FAILED_STATUS,
    MAX_ERROR_CHARS,
    ArenaBlock,
    ErrorRecord,
    Found,
    Record,
    matrix_bytes,
    pack_error,
    pack_record,
    record_fields,
)

MAGIC = b"VHSRING\x00"
LAYOUT_VERSION = 4
KEY_BYTES = REQUEST_KEY_BYTES

#: Native 8-byte format (a single memcpy in CPython's struct) where native == little-endian;
#: standard little-endian (byte-wise) otherwise. Same bytes on disk either way.
_U64_ATOMIC_FMT = "@Q" if sys.byteorder == "little" else "<Q"

HDR_MAGIC_OFFSET = 0
HDR_MAGIC_FMT = "<8s"
HDR_VERSION_OFFSET = 8
HDR_VERSION_FMT = "<I"
HDR_HEADER_SIZE_OFFSET = 12
HDR_HEADER_SIZE_FMT = "<I"
HDR_SLOT_SIZE_OFFSET = 16
HDR_SLOT_SIZE_FMT = "<I"
HDR_SLOT_COUNT_OFFSET = 20
HDR_SLOT_COUNT_FMT = "<I"
HDR_KEY_SIZE_OFFSET = 24
HDR_KEY_SIZE_FMT = "<I"
HDR_HIDDEN_SIZE_OFFSET = 28
HDR_HIDDEN_SIZE_FMT = "<I"
HDR_EPOCH_OFFSET = 32
HDR_EPOCH_FMT = "<Q"
HDR_WRITER_PID_OFFSET = 40
HDR_WRITER_PID_FMT = "<I"
HDR_ENGINE_OFFSET = 44
HDR_ENGINE_FMT = "<I"
HDR_PUBLISH_COUNT_OFFSET = 48
HDR_PUBLISH_COUNT_FMT = _U64_ATOMIC_FMT
HDR_INSTANCE_OFFSET = 56
HDR_INSTANCE_FMT = "<Q"
HDR_NUM_LAYERS_OFFSET = 64
HDR_NUM_LAYERS_FMT = "<I"
HDR_LAYER_COUNT_OFFSET = 68
HDR_LAYER_COUNT_FMT = "<I"
HDR_RUNNER_OFFSET = 72
HDR_RUNNER_FMT = "<48s"
HDR_ARENA_SIZE_OFFSET = 120
HDR_ARENA_SIZE_FMT = "<Q"
HDR_MAX_RECORD_OFFSET = 128
HDR_MAX_RECORD_FMT = "<Q"
HDR_LAYERS_OFFSET = 136
LAYER_FMT = "<I"
#: The fixed part of the header, before the captured layers.
FIXED_HEADER_SIZE = HDR_LAYERS_OFFSET
#: The fixed part in one format (version included; the writer rewrites it last).
FIXED_HEADER_FMT = "<8sIIIIIIQIIQQII48sQQ"

INDEX_ENTRY_SIZE = KEY_BYTES

SLOT_ALIGN = 64
SLOT_SEQ_OFFSET = 0
SLOT_SEQ_FMT = _U64_ATOMIC_FMT
SLOT_KEY_OFFSET = 8
SLOT_KEY_FMT = f"<{KEY_BYTES}s"
SLOT_LEN_OFFSET = 24
SLOT_LEN_FMT = "<I"
SLOT_CRC_OFFSET = 28
SLOT_CRC_FMT = "<I"
SLOT_PAYLOAD_OFFSET = 32
SLOT_HEADER_SIZE = SLOT_PAYLOAD_OFFSET
#: key, length and crc read/written in one go, at SLOT_KEY_OFFSET.
SLOT_META_FMT = f"<{KEY_BYTES}sII"

ARENA_SEQ_OFFSET = 0
ARENA_SEQ_FMT = _U64_ATOMIC_FMT
ARENA_KEY_OFFSET = 8
ARENA_KEY_FMT = f"<{KEY_BYTES}s"
ARENA_LEN_OFFSET = 24
ARENA_LEN_FMT = "<Q"
ARENA_CRC_OFFSET = 32
ARENA_CRC_FMT = "<I"
ARENA_PAD_OFFSET = 36
ARENA_PAYLOAD_OFFSET = 64
#: key, length and crc in one go, at ARENA_KEY_OFFSET.
ARENA_META_FMT = f"<{KEY_BYTES}sQI"

#: Sanity limits a reader applies to a header before mapping anything.
MAX_SLOT_COUNT = 1 << 24
MAX_HIDDEN_SIZE = 1 << 24
MAX_SLOT_SIZE = 1 << 30
MAX_NUM_HIDDEN_LAYERS = 1 << 16
#: The largest arena a header may describe (1 TiB).
MAX_ARENA_SIZE = 1 << 40

FIXED_HEADER = struct.Struct(FIXED_HEADER_FMT)
VERSION = struct.Struct(HDR_VERSION_FMT)
PUBLISH_COUNT = struct.Struct(HDR_PUBLISH_COUNT_FMT)
SEQ = struct.Struct(SLOT_SEQ_FMT)
ARENA_SEQ = struct.Struct(ARENA_SEQ_FMT)
SLOT_META = struct.Struct(SLOT_META_FMT)
ARENA_META = struct.Struct(ARENA_META_FMT)
ZERO_KEY = bytes(KEY_BYTES)


class LayoutError(Exception):
    """The constants above disagree with each other (a bug in this module)."""


class RingFormatError(Exception):
    """A ring file is not (or no longer) a valid, trusted ring of this layout version."""


def check_layout() -> None:
    """Import-time proof that the named offsets/formats and the packed structs agree.

    Raises :class:`LayoutError` (not ``assert``, which ``python -O`` removes).
    """
    header_fields = [
        (HDR_MAGIC_OFFSET, HDR_MAGIC_FMT),
        (HDR_VERSION_OFFSET, HDR_VERSION_FMT),
        (HDR_HEADER_SIZE_OFFSET, HDR_HEADER_SIZE_FMT),
        (HDR_SLOT_SIZE_OFFSET, HDR_SLOT_SIZE_FMT),
        (HDR_SLOT_COUNT_OFFSET, HDR_SLOT_COUNT_FMT),
        (HDR_KEY_SIZE_OFFSET, HDR_KEY_SIZE_FMT),
        (HDR_HIDDEN_SIZE_OFFSET, HDR_HIDDEN_SIZE_FMT),
        (HDR_EPOCH_OFFSET, HDR_EPOCH_FMT),
        (HDR_WRITER_PID_OFFSET, HDR_WRITER_PID_FMT),
        (HDR_ENGINE_OFFSET, HDR_ENGINE_FMT),
        (HDR_PUBLISH_COUNT_OFFSET, HDR_PUBLISH_COUNT_FMT),
        (HDR_INSTANCE_OFFSET, HDR_INSTANCE_FMT),
        (HDR_NUM_LAYERS_OFFSET, HDR_NUM_LAYERS_FMT),
        (HDR_LAYER_COUNT_OFFSET, HDR_LAYER_COUNT_FMT),
        (HDR_RUNNER_OFFSET, HDR_RUNNER_FMT),
        (HDR_ARENA_SIZE_OFFSET, HDR_ARENA_SIZE_FMT),
        (HDR_MAX_RECORD_OFFSET, HDR_MAX_RECORD_FMT),
        (HDR_LAYERS_OFFSET, ""),
    ]
    slot_fields = [
        (SLOT_SEQ_OFFSET, SLOT_SEQ_FMT),
        (SLOT_KEY_OFFSET, SLOT_KEY_FMT),
        (SLOT_LEN_OFFSET, SLOT_LEN_FMT),
        (SLOT_CRC_OFFSET, SLOT_CRC_FMT),
        (SLOT_PAYLOAD_OFFSET, ""),
    ]
    arena_fields = [
        (ARENA_SEQ_OFFSET, ARENA_SEQ_FMT),
        (ARENA_KEY_OFFSET, ARENA_KEY_FMT),
        (ARENA_LEN_OFFSET, ARENA_LEN_FMT),
        (ARENA_CRC_OFFSET, ARENA_CRC_FMT),
        (ARENA_PAD_OFFSET, ""),
    ]
    for fields in (header_fields, slot_fields, arena_fields):
        for (offset, fmt), (next_offset, _) in itertools.pairwise(fields):
            if offset + struct.calcsize(fmt) != next_offset:
                raise LayoutError(f"field at {offset} ({fmt}) does not end at {next_offset}")
    if FIXED_HEADER.size != FIXED_HEADER_SIZE:
        raise LayoutError(f"fixed header packs {FIXED_HEADER.size} bytes, not {FIXED_HEADER_SIZE}")
    if SLOT_KEY_OFFSET + SLOT_META.size != SLOT_PAYLOAD_OFFSET:
        raise LayoutError("slot key, length and crc do not end at the payload")
    if ARENA_KEY_OFFSET + ARENA_META.size != ARENA_PAD_OFFSET or ARENA_PAD_OFFSET > 64:
        raise LayoutError("arena block key, length and crc do not end at its padding")
    if ARENA_PAYLOAD_OFFSET % SLOT_ALIGN:
        raise LayoutError("an arena block's payload must start 64-byte aligned")
    if HDR_PUBLISH_COUNT_OFFSET % 8 or SLOT_SEQ_OFFSET % 8 or SLOT_ALIGN % 8:
        raise LayoutError("the publish counter and the seqlock must be 8-byte aligned")


check_layout()


def align(n: int, to: int = SLOT_ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class RingShape:
    """What a ring's header fixes: sizes, and the layers every record may hold."""

    slot_count: int
    slot_size: int
    hidden_size: int
    #: The model's decoder layer count N: layer N is the final layer after the final norm.
    num_hidden_layers: int
    #: Captured layers, ascending absolute indices in [0, N].
    layers: tuple[int, ...]
    #: Bytes of the arena (a multiple of 64; 0: the ring carries no matrices).
    arena_size: int = 0
    #: The most bytes one matrix record's payload may have (at most ``arena_size``).
    max_record: int = 0
    # Derived once (lookups read them on every call).
    header_size: int = field(init=False)
    index_offset: int = field(init=False)
    index_end: int = field(init=False)
    slots_offset: int = field(init=False)
    arena_offset: int = field(init=False)
    file_size: int = field(init=False)
    payload_capacity: int = field(init=False)

    def __post_init__(self) -> None:
        header_size = align(FIXED_HEADER_SIZE + struct.calcsize(LAYER_FMT) * len(self.layers))
        index_end = header_size + self.slot_count * INDEX_ENTRY_SIZE
        slots_offset = align(index_end)
        arena_offset = slots_offset + self.slot_count * self.slot_size
        derived = {
            "header_size": header_size,
            "index_offset": header_size,
            "index_end": index_end,
            "slots_offset": slots_offset,
            "arena_offset": arena_offset,
            "file_size": arena_offset + self.arena_size,
            "payload_capacity": self.slot_size - SLOT_HEADER_SIZE,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def model_dims(self) -> tuple[int, int]:
        """``(hidden_size, num_hidden_layers)``: equal for the rings of servers of one model."""
        return self.hidden_size, self.num_hidden_layers


@dataclass(frozen=True, slots=True)
class RingHeader:
    """A ring file's header: its shape and who writes it."""

    shape: RingShape
    epoch: int
    writer_pid: int
    #: vLLM's ``data_parallel_index`` of the engine whose worker writes this ring.
    engine: int
    #: Shared by the engines of one vLLM server (from vLLM's ``instance_id``).
    instance: int
    #: Which vLLM and model runner the writer's hook wraps ("vLLM 0.32.0 V1 CPUModelRunner");
    #: empty if the writer did not say. Shown by ``/metrics`` and ``check``.
    runner: str = ""


def check_layers(layers: tuple[int, ...], num_hidden_layers: int) -> None:
    """Raise ``ValueError`` unless ``layers`` are ascending, unique and within [0, N]."""
    if not 1 <= num_hidden_layers <= MAX_NUM_HIDDEN_LAYERS:
        raise ValueError(
            f"num_hidden_layers must be in [1, {MAX_NUM_HIDDEN_LAYERS}], got {num_hidden_layers}"
        )
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"between 1 and {MAX_LAYERS} layers, got {len(layers)}")
    ascending = list(layers) == sorted(set(layers))
    if not ascending or not 0 <= layers[0] <= layers[-1] <= num_hidden_layers:
        raise ValueError(
            f"layers must be ascending and unique in [0, {num_hidden_layers}]: {layers}"
        )


def pack_header(header: RingHeader) -> bytes:
    """The header's bytes with layout version 0 ("not ready"); the writer sets it last."""
    shape = header.shape
    fixed = FIXED_HEADER.pack(
        MAGIC,
        0,
        shape.header_size,
        shape.slot_size,
        shape.slot_count,
        KEY_BYTES,
        shape.hidden_size,
        header.epoch,
        header.writer_pid & 0xFFFFFFFF,
        header.engine,
        0,
        header.instance,
        shape.num_hidden_layers,
        len(shape.layers),
        runner_field(header.runner),
        shape.arena_size,
        shape.max_record,
    )
    layers = struct.pack(f"<{len(shape.layers)}I", *shape.layers)
    return (fixed + layers).ljust(shape.header_size, b"\x00")


def runner_field(runner: str) -> bytes:
    """``runner`` as the header's field: printable ASCII (others become ``?``), cut to fit."""
    text = "".join(c if c.isascii() and c.isprintable() else "?" for c in runner)
    return text.encode("ascii")[: struct.calcsize(HDR_RUNNER_FMT)]


def fixed_header_fields(raw: bytes) -> tuple[int, int]:
    """(header size, captured layer count) from the fixed part, to know how much to read."""
    fields = FIXED_HEADER.unpack_from(raw)
    return fields[2], fields[13]


def parse_header(raw: bytes, file_size: int) -> RingHeader:
    """Validate a whole header (``raw``: at least its header-size bytes) against the file size.

    Raises :class:`RingFormatError` naming the first problem; nothing is mapped before this.
    """
    if len(raw) < FIXED_HEADER_SIZE:
        raise RingFormatError(f"truncated header ({len(raw)} of {FIXED_HEADER_SIZE} bytes)")
    (
        magic,
        version,
        header_size,
        slot_size,
        slot_count,
        key_size,
        hidden_size,
        epoch,
        writer_pid,
        engine,
        _publish_count,
        instance,
        num_hidden_layers,
        layer_count,
        runner,
        arena_size,
        max_record,
    ) = FIXED_HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise RingFormatError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version == 0:
        raise RingFormatError("not ready (layout version 0: the writer has not finished it)")
    if version != LAYOUT_VERSION:
        raise RingFormatError(
            f"unsupported layout version {version} (expected {LAYOUT_VERSION}): the worker hook "
            "in vLLM and this proxy come from different releases of vllm-hidden-state-proxy"
        )
    if key_size != KEY_BYTES:
        raise RingFormatError(f"key size {key_size} (expected {KEY_BYTES})")
    if not 1 <= slot_count <= MAX_SLOT_COUNT:
        raise RingFormatError(f"slot count {slot_count} out of range [1, {MAX_SLOT_COUNT}]")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise RingFormatError(f"hidden size {hidden_size} out of range [1, {MAX_HIDDEN_SIZE}]")
    if not 1 <= layer_count <= MAX_LAYERS:
        raise RingFormatError(f"captured layer count {layer_count} out of range [1, {MAX_LAYERS}]")
    expected_header = align(FIXED_HEADER_SIZE + 4 * layer_count)
    if header_size != expected_header:
        raise RingFormatError(f"header size {header_size} (expected {expected_header})")
    if len(raw) < header_size:
        raise RingFormatError(f"truncated header ({len(raw)} of {header_size} bytes)")
    layers = struct.unpack_from(f"<{layer_count}I", raw, HDR_LAYERS_OFFSET)
    try:
        check_layers(layers, num_hidden_layers)
    except ValueError as exc:
        raise RingFormatError(f"captured layers: {exc}") from None
    min_slot = slot_size_for(hidden_size, layer_count, "")
    if slot_size % SLOT_ALIGN or not min_slot <= slot_size <= MAX_SLOT_SIZE:
        raise RingFormatError(
            f"slot size {slot_size} invalid for hidden size {hidden_size} and {layer_count} "
            f"layers (need a multiple of {SLOT_ALIGN} in [{min_slot}, {MAX_SLOT_SIZE}])"
        )
    if arena_size % SLOT_ALIGN or not 0 <= max_record <= arena_size <= MAX_ARENA_SIZE:
        raise RingFormatError(
            f"arena of {arena_size} bytes (max record {max_record}) invalid (need a multiple of "
            f"{SLOT_ALIGN} up to {MAX_ARENA_SIZE}, and a max record no larger)"
        )
    shape = RingShape(
        slot_count, slot_size, hidden_size, num_hidden_layers, layers, arena_size, max_record
    )
    if file_size != shape.file_size:
        raise RingFormatError(
            f"file is {file_size} bytes but the header describes {shape.file_size} "
            f"({slot_count} slots x {slot_size} bytes, an arena of {arena_size})"
        )
    raw_runner = runner.rstrip(b"\x00")
    text = raw_runner.decode("ascii", "replace")
    if not raw_runner.isascii() or not text.isprintable():
        raise RingFormatError(f"runner field {raw_runner!r} is not printable ASCII")
    return RingHeader(shape, epoch, writer_pid, engine, instance, text)


# ---------------------------------------------------------------------------------------------
# Records in a ring (their coding: :mod:`.records`)
# ---------------------------------------------------------------------------------------------


def slot_size_for(hidden_size: int, layer_count: int, model: str) -> int:
    """Bytes per slot: slot header plus the largest payload of this shape, rounded up to 64."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise TypeError("hidden_size must be an int")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden_size must be in [1, {MAX_HIDDEN_SIZE}], got {hidden_size}")
    if not 1 <= layer_count <= MAX_LAYERS:
        raise ValueError(f"layer_count must be in [1, {MAX_LAYERS}], got {layer_count}")
    most = (1 << 64) - 1
    worst_record = Record(
        key=ZERO_KEY,
        model=model,
        position=most,
        num_prompt_tokens=most,
        pooling=max(POOLINGS, key=len),
        layers=(MAX_NUM_HIDDEN_LAYERS,) * layer_count,
        hidden_size=hidden_size,
        vectors=bytes(4 * hidden_size * layer_count),
    )
    worst_matrix = pack_record(
        Record(**{**record_fields(worst_record), "rows": most}), ArenaBlock(most, most, most, most)
    )
    worst_error = pack_error(ZERO_KEY, "\U0010ffff" * MAX_ERROR_CHARS, max(ERROR_STATUSES))
    payload = max(len(pack_record(worst_record)), len(worst_matrix), len(worst_error))
    return align(SLOT_HEADER_SIZE + payload)


def arena_block_size(length: int) -> int:
    """The arena bytes a block of a ``length``-byte payload takes."""
    return align(ARENA_PAYLOAD_OFFSET + length)


#: A decoded slot: a record, or a matrix record with the block its rows are still to be read from.
Decoded = Found | tuple[Record, ArenaBlock]


def decode_payload(obj: Any, key: bytes, shape: RingShape) -> Decoded | None:
    """A decoded payload as a record for ``key`` (a matrix record: with its block, its rows
    still to be read), or ``None`` if it is not exactly one."""
    if type(obj) is not dict or obj.get("key") != key or type(obj["key"]) is not bytes:
        return None
    if "error" in obj:
        message = obj["error"]
        status = obj.get("status", HOOK_FAILED_STATUS)
        if type(message) is not str or type(status) is not int or status not in ERROR_STATUSES:
            return None
        return ErrorRecord(key, message, status)
    layers = obj.get("layers")
    position = obj.get("position")
    num_prompt_tokens = obj.get("num_prompt_tokens")
    pooling = obj.get("pooling")
    model = obj.get("model")
    if (
        type(layers) is not list
        or not layers
        or not all(type(layer) is int and layer in shape.layers for layer in layers)
        or len(set(layers)) != len(layers)
        or type(position) is not int
        or type(num_prompt_tokens) is not int
        or pooling not in POOLINGS
        or type(model) is not str
    ):
        return None
    if pooling in MATRIX_POOLINGS:
        return _matrix_record(obj, key, shape, model, position, num_prompt_tokens, pooling, layers)
    vectors = obj.get("vectors")
    if type(vectors) is not bytes or len(vectors) != 4 * shape.hidden_size * len(layers):
        return None
    return Record(
        key=key,
        model=model,
        position=position,
        num_prompt_tokens=num_prompt_tokens,
        pooling=pooling,
        layers=tuple(layers),
        hidden_size=shape.hidden_size,
        vectors=vectors,
    )


def _matrix_record(
    obj: dict[str, Any],
    key: bytes,
    shape: RingShape,
    model: str,
    position: int,
    num_prompt_tokens: int,
    pooling: str,
    layers: list[int],
) -> tuple[Record, ArenaBlock] | None:
    rows = obj.get("rows")
    block = obj.get("arena")
    if (
        type(rows) is not int
        or rows < 1
        or type(block) is not list
        or len(block) != 4
        or not all(type(value) is int and value >= 0 for value in block)
    ):
        return None
    offset, length, crc, seq = block
    if (
        length != matrix_bytes(rows, len(layers), shape.hidden_size)
        or length > shape.max_record
        or offset % SLOT_ALIGN
        or offset + arena_block_size(length) > shape.arena_size
        or seq & 1
    ):
        return None
    prompt, hidden = num_prompt_tokens, shape.hidden_size
    record = Record(key, model, position, prompt, pooling, tuple(layers), hidden, b"", rows)
    return record, ArenaBlock(offset, length, crc, seq)
