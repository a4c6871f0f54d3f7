"""A ring's records as Python objects, and their coding as a slot's msgpack payload.

What each field means and where it sits: the byte ruler in :mod:`.layout`.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any

import msgpack

#: Longest error message an error record carries (longer ones are cut).
MAX_ERROR_CHARS = 1000


#: Little-endian float32 values: a record's, or a view of part of them.
Rows = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Record:
    """The vectors (or, for a matrix pooling, the rows) published for one request key."""

    key: bytes
    model: str
    #: Prompt position of the "last" vectors (num_prompt_tokens - 1); of a matrix's first row.
    position: int
    num_prompt_tokens: int
    pooling: str
    #: Absolute layer indices, in the order of ``vectors``.
    layers: tuple[int, ...]
    hidden_size: int
    #: Little-endian float32, ``rows`` x ``hidden_size`` values per layer, layer after layer
    #: (a large matrix's rows, copied out of the ring in steps, come as a view of the array they
    #: were copied into; a cut of them as a view).
    vectors: Rows
    #: Positions per layer: 1 for a vector, more for a matrix (consecutive, from ``position``).
    rows: int = 1

    def vector(self, layer: int) -> Rows:
        """One layer's vector (or matrix: ``rows`` vectors) as little-endian float32 bytes (a
        view of the record's, not a copy); ``KeyError`` if not in the record."""
        try:
            index = self.layers.index(layer)
        except ValueError:
            raise KeyError(layer) from None
        size = 4 * self.hidden_size * self.rows
        if len(self.layers) == 1 and len(self.vectors) == size:
            return self.vectors
        return memoryview(self.vectors)[index * size : (index + 1) * size]

    def floats(self, layer: int) -> list[float]:
        """One layer's vector (a matrix's rows one after another) as Python floats."""
        values = array("f")
        values.frombytes(self.vector(layer))
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()

    def first_rows(self, count: int) -> Record:
        """The record of this matrix's first ``count`` rows (``ValueError`` past its rows)."""
        if not 1 <= count <= self.rows:
            raise ValueError(f"{count} rows of a matrix of {self.rows}")
        size = 4 * self.hidden_size
        cut: Rows
        if len(self.layers) == 1:  # a view: no copy of a large matrix
            cut = memoryview(self.vectors)[: count * size]
        else:
            cut = b"".join(memoryview(self.vector(layer))[: count * size] for layer in self.layers)
        return Record(
            self.key,
            self.model,
            self.position,
            self.num_prompt_tokens,
            self.pooling,
            self.layers,
            self.hidden_size,
            cut,
            count,
        )


#: The HTTP status of an error record that does not name one: the hook failed.
HOOK_FAILED_STATUS = 502


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """The hook's word that it could not produce this request key's vectors, and why."""

    key: bytes
    message: str
    #: What it means to the client: 502 the hook failed, 400 the request asked for what its
    #: prompt does not have, 409 prompt positions were served from the prefix cache (a prompt
    #: of a list that hit another's blocks: the proxy sends it again alone), 413 a limit of one
    #: request, 503 one of the engine (busy: retry).
    status: int = HOOK_FAILED_STATUS


@dataclass(frozen=True, slots=True)
class ArenaBlock:
    """Where a matrix record's rows are: its block in the arena, as the slot record says."""

    offset: int
    length: int
    crc: int
    seq: int


Found = Record | ErrorRecord

#: The status of an error record for a pooling that needs every prompt position when some were
#: served from the prefix cache (``worker_hook.selection.MeanGap``).
PREFIX_GAP_STATUS = 409
#: The statuses an error record may carry.
ERROR_STATUSES = (HOOK_FAILED_STATUS, 400, PREFIX_GAP_STATUS, 413, 503)


def pack_record(record: Record, block: ArenaBlock | None = None) -> bytes:
    """A record's slot payload: with ``block``, a matrix record pointing at its rows there."""
    fields: dict[str, Any] = {
        "key": record.key,
        "model": record.model,
        "position": record.position,
        "num_prompt_tokens": record.num_prompt_tokens,
        "pooling": record.pooling,
        "layers": list(record.layers),
    }
    if block is None:
        fields["vectors"] = record.vectors
    else:
        fields["rows"] = record.rows
        fields["arena"] = [block.offset, block.length, block.crc, block.seq]
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def pack_error(key: bytes, message: str, status: int = HOOK_FAILED_STATUS) -> bytes:
    text = message[:MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
    fields: dict[str, Any] = {"key": key, "error": text}
    if status != HOOK_FAILED_STATUS:
        fields["status"] = status
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def record_fields(record: Record) -> dict[str, Any]:
    return {name: getattr(record, name) for name in Record.__slots__}


def matrix_bytes(rows: int, layer_count: int, hidden_size: int) -> int:
    """A matrix record's payload: ``rows`` float32 rows of ``hidden_size`` per layer."""
    return 4 * rows * layer_count * hidden_size
