"""The ring file's layout: the byte ruler, its constants, header validation and record coding.

File ``<directory>/ring-<instance>-dp<engine>.bin`` (one per engine), little-endian throughout
(N = slot count, Z = slot size, L = captured layer count)::

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
       120 | captured layers u32 x L (ascending, 0..N)     | HDR_LAYERS_OFFSET / LAYER_FMT
           | zero padding up to H = align64(120 + 4 L)     |
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
  S + N*Z  +-----------------------------------------------+ = file size

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
           |   "pooling": "last" | "mean"                  |
           |   "layers": [int] (a subset of the captured)  |
           |   "vectors": bytes (LE f32, layer after layer)|
           | or an error record:                           |
           |   "key": bytes (16)     "error": str          |
           +-----------------------------------------------+
           | unused up to Z                                |
        +Z +-----------------------------------------------+

A layer index ``k`` is Transformers' ``output_hidden_states`` index: 0 the embeddings, ``k`` the
residual stream after ``k`` decoder layers, ``N`` the final layer after the final norm.

Publishing, looking up, liveness: see :mod:`.writer`, :mod:`.reader` and :mod:`.directory`.
"""

from __future__ import annotations

import itertools
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack

from vllm_hidden_state_proxy.protocol import POOLINGS, REQUEST_KEY_BYTES

MAGIC = b"VHSRING\x00"
LAYOUT_VERSION = 3
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
HDR_LAYERS_OFFSET = 120
LAYER_FMT = "<I"
#: The fixed part of the header, before the captured layers.
FIXED_HEADER_SIZE = HDR_LAYERS_OFFSET
#: The fixed part in one format (version included; the writer rewrites it last).
FIXED_HEADER_FMT = "<8sIIIIIIQIIQQII48s"

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

#: Sanity limits a reader applies to a header before mapping anything.
MAX_SLOT_COUNT = 1 << 24
MAX_HIDDEN_SIZE = 1 << 24
MAX_SLOT_SIZE = 1 << 30
MAX_NUM_HIDDEN_LAYERS = 1 << 16
MAX_LAYERS = 1024
#: Longest error message an error record carries (longer ones are cut).
MAX_ERROR_CHARS = 1000

FIXED_HEADER = struct.Struct(FIXED_HEADER_FMT)
VERSION = struct.Struct(HDR_VERSION_FMT)
PUBLISH_COUNT = struct.Struct(HDR_PUBLISH_COUNT_FMT)
SEQ = struct.Struct(SLOT_SEQ_FMT)
SLOT_META = struct.Struct(SLOT_META_FMT)
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
        (HDR_LAYERS_OFFSET, ""),
    ]
    slot_fields = [
        (SLOT_SEQ_OFFSET, SLOT_SEQ_FMT),
        (SLOT_KEY_OFFSET, SLOT_KEY_FMT),
        (SLOT_LEN_OFFSET, SLOT_LEN_FMT),
        (SLOT_CRC_OFFSET, SLOT_CRC_FMT),
        (SLOT_PAYLOAD_OFFSET, ""),
    ]
    for fields in (header_fields, slot_fields):
        for (offset, fmt), (next_offset, _) in itertools.pairwise(fields):
            if offset + struct.calcsize(fmt) != next_offset:
                raise LayoutError(f"field at {offset} ({fmt}) does not end at {next_offset}")
    if FIXED_HEADER.size != FIXED_HEADER_SIZE:
        raise LayoutError(f"fixed header packs {FIXED_HEADER.size} bytes, not {FIXED_HEADER_SIZE}")
    if SLOT_KEY_OFFSET + SLOT_META.size != SLOT_PAYLOAD_OFFSET:
        raise LayoutError("slot key, length and crc do not end at the payload")
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
    # Derived once (lookups read them on every call).
    header_size: int = field(init=False)
    index_offset: int = field(init=False)
    index_end: int = field(init=False)
    slots_offset: int = field(init=False)
    file_size: int = field(init=False)
    payload_capacity: int = field(init=False)

    def __post_init__(self) -> None:
        header_size = align(FIXED_HEADER_SIZE + struct.calcsize(LAYER_FMT) * len(self.layers))
        index_end = header_size + self.slot_count * INDEX_ENTRY_SIZE
        slots_offset = align(index_end)
        derived = {
            "header_size": header_size,
            "index_offset": header_size,
            "index_end": index_end,
            "slots_offset": slots_offset,
            "file_size": slots_offset + self.slot_count * self.slot_size,
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
    shape = RingShape(slot_count, slot_size, hidden_size, num_hidden_layers, layers)
    if file_size != shape.file_size:
        raise RingFormatError(
            f"file is {file_size} bytes but the header describes {shape.file_size} "
            f"({slot_count} slots x {slot_size} bytes)"
        )
    raw_runner = runner.rstrip(b"\x00")
    text = raw_runner.decode("ascii", "replace")
    if not raw_runner.isascii() or not text.isprintable():
        raise RingFormatError(f"runner field {raw_runner!r} is not printable ASCII")
    return RingHeader(shape, epoch, writer_pid, engine, instance, text)


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """The vectors published for one request key."""

    key: bytes
    model: str
    #: Prompt position of the "last" vectors (num_prompt_tokens - 1).
    position: int
    num_prompt_tokens: int
    pooling: str
    #: Absolute layer indices, in the order of ``vectors``.
    layers: tuple[int, ...]
    hidden_size: int
    #: Little-endian float32, ``hidden_size`` values per layer, layer after layer.
    vectors: bytes

    def vector(self, layer: int) -> bytes:
        """One layer's vector (little-endian float32 bytes); ``KeyError`` if not in the record."""
        try:
            index = self.layers.index(layer)
        except ValueError:
            raise KeyError(layer) from None
        size = 4 * self.hidden_size
        return self.vectors[index * size : (index + 1) * size]

    def floats(self, layer: int) -> list[float]:
        """One layer's vector as Python floats."""
        values = array("f")
        values.frombytes(self.vector(layer))
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """The hook's word that it could not produce this request key's vectors, and why."""

    key: bytes
    message: str


Found = Record | ErrorRecord


def pack_record(record: Record) -> bytes:
    packed: bytes = msgpack.packb(
        {
            "key": record.key,
            "model": record.model,
            "position": record.position,
            "num_prompt_tokens": record.num_prompt_tokens,
            "pooling": record.pooling,
            "layers": list(record.layers),
            "vectors": record.vectors,
        },
        use_bin_type=True,
    )
    return packed


def pack_error(key: bytes, message: str) -> bytes:
    text = message[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
    packed: bytes = msgpack.packb({"key": key, "error": text}, use_bin_type=True)
    return packed


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
    worst_error = pack_error(ZERO_KEY, "\U0010ffff" * MAX_ERROR_CHARS)
    return align(SLOT_HEADER_SIZE + max(len(pack_record(worst_record)), len(worst_error)))


def decode_payload(obj: Any, key: bytes, shape: RingShape) -> Found | None:
    """A decoded payload as a record for ``key``, or ``None`` if it is not exactly one."""
    if type(obj) is not dict or obj.get("key") != key or type(obj["key"]) is not bytes:
        return None
    if "error" in obj:
        message = obj["error"]
        return ErrorRecord(key, message) if type(message) is str else None
    vectors = obj.get("vectors")
    layers = obj.get("layers")
    position = obj.get("position")
    num_prompt_tokens = obj.get("num_prompt_tokens")
    pooling = obj.get("pooling")
    model = obj.get("model")
    if (
        type(vectors) is not bytes
        or type(layers) is not list
        or not layers
        or not all(type(layer) is int and layer in shape.layers for layer in layers)
        or len(set(layers)) != len(layers)
        or len(vectors) != 4 * shape.hidden_size * len(layers)
        or type(position) is not int
        or type(num_prompt_tokens) is not int
        or pooling not in POOLINGS
        or type(model) is not str
    ):
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
