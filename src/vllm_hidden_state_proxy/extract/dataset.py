"""The dataset on disk: Parquet part files written as results arrive, a manifest, an errors file.

::

    DIR/
      part-00000.parquet    one row per input and choice (id, choice, positions, a column per
      part-00001.parquet    layer); every run writes new parts, each first as .part-*.tmp and
      ...                   renamed when closed, so a part file is always whole
      _manifest.json        model, hidden size, layers, pooling, dtype, the capture description,
                            counts, each run's command line
      _errors.jsonl         this run's inputs that failed: {"line", "id", "status", "reason"}

(Names that start with ``_`` or ``.`` are what pyarrow's datasets skip: ``pq.read_table(DIR)``
reads the parts alone.) Every file is created exclusively (``O_EXCL``: never onto a name that
exists, never through a symbolic link); what else the directory may hold is ``output_dir.py``'s.
Each part's schema carries the settings it was made with (:data:`SETTINGS_KEY`), which
``--resume`` compares (``resume.py``).

A layer column is ``layer_K`` (``K`` the absolute index: ``-1`` is ``num_hidden_layers``): a
fixed-size list of ``hidden_size`` floats (a vector), or for matrices a list of them (one per
position or span). Matrices stay in Parquet, not in NumPy or safetensors shards: a matrix's row
count differs per input, which a list column holds with its id beside it in one file that
pyarrow, pandas and ``datasets`` read, where shards would need an index of offsets kept in step.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import IO, Any

import numpy as np

from vllm_hidden_state_proxy.extract.storage import (
    Location,
    StorePath,
    parquet_source,
    replace,
)

MANIFEST = "_manifest.json"
ERRORS = "_errors.jsonl"
_PART_GLOB = "part-*.parquet"
#: A part's name, and a part's while it is written.
PART = re.compile(r"part-(\d{5,})\.parquet")
UNFINISHED_PART = re.compile(r"\.part-(\d{5,})\.parquet\.tmp")
#: The manifest while it is written (a fresh name each time), before it replaces the last.
UNFINISHED_MANIFEST = re.compile(r"\._manifest\.json(\.[0-9a-f]+)?\.tmp")
#: The key of each part's schema metadata that holds the settings it was made with (JSON).
SETTINGS_KEY = b"vllm_hidden_state_proxy.settings"
#: Flags of every file the dataset's writer creates: a new name only, never through a link.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
#: A row group is written early once its arrays hold this many bytes (matrices of long prompts:
#: a few rows can hold hundreds of MiB).
ROW_GROUP_BYTES = 64 * 1024 * 1024


def part_files(directory: Location) -> list[Location]:
    """Every ``part-*.parquet`` (a name not :data:`PART`'s is refused by ``output_dir.py``)."""
    return sorted(directory.glob(_PART_GLOB))


def create_file(path: Location, mode: str = "w") -> IO[Any]:
    """A new file at ``path``: ``FileExistsError`` if anything is there (a link included)."""
    if isinstance(path, StorePath):
        return path.create(mode)
    descriptor = os.open(path, _CREATE, 0o666)
    if "b" in mode:
        return os.fdopen(descriptor, mode)
    return os.fdopen(descriptor, mode, encoding="utf-8")


def existing_ids(directory: Location) -> set[str]:
    """The ids the dataset's whole part files hold (what ``--resume`` skips)."""
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for part in part_files(directory):
        with parquet_source(part) as source:
            ids.update(pq.read_table(source, columns=["id"]).column("id").to_pylist())
    return ids


def count_rows(directory: Location) -> int:
    import pyarrow.parquet as pq

    rows = 0
    for part in part_files(directory):
        with parquet_source(part) as source:
            rows += pq.ParquetFile(source).metadata.num_rows
    return rows


def read_manifest(directory: Location) -> dict[str, Any] | None:
    """The manifest as written (``output_dir.py`` checks one a run is to trust)."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    return dict(json.loads(path.read_text(encoding="utf-8")))


def write_manifest(directory: Location, manifest: Mapping[str, Any]) -> None:
    """Write the manifest whole under a fresh name, then put it in place (a reader sees the
    last one or this one, never half)."""
    temporary = directory / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"
    with create_file(temporary) as file:
        file.write(json.dumps(manifest, indent=2) + "\n")
    replace(temporary, directory / MANIFEST)


def column_name(layer: int) -> str:
    return f"layer_{layer}"


def dataset_schema(
    layers: Sequence[int],
    *,
    hidden_size: int,
    matrix: bool,
    dtype: str,
    settings: Mapping[str, Any] | None = None,
) -> Any:
    """The parts' Arrow schema; ``settings`` (what made the vectors) in its metadata."""
    import pyarrow as pa

    value = pa.float16() if dtype == "float16" else pa.float32()
    vector = pa.list_(value, hidden_size)
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("choice", pa.int32(), nullable=False),
        pa.field("position", pa.int32()),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_output_tokens", pa.int32()),
    ]
    fields += [
        pa.field(column_name(k), pa.list_(vector) if matrix else vector, nullable=False)
        for k in layers
    ]
    metadata = None if settings is None else {SETTINGS_KEY: json.dumps(settings).encode()}
    return pa.schema(fields, metadata=metadata)


def _layer_array(
    arrays: Sequence[np.ndarray | None], *, hidden_size: int, matrix: bool, dtype: np.dtype[Any]
) -> Any:
    """One layer's column: a vector (or a matrix) per row; null where the array is ``None``
    (the mapper's failed inputs: the writer has none)."""
    import pyarrow as pa

    mask = None
    if any(a is None for a in arrays):
        mask = pa.array([a is None for a in arrays])
        empty = np.zeros((0, hidden_size) if matrix else (hidden_size,), dtype)
        arrays = [empty if a is None else a for a in arrays]
    present: list[np.ndarray] = [a for a in arrays if a is not None]
    if not matrix:
        flat = np.concatenate([a.reshape(-1) for a in present]).astype(dtype, copy=False)
        return pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden_size, mask=mask)
    rows = np.concatenate([a.reshape(-1, hidden_size) for a in present])
    flat = rows.reshape(-1).astype(dtype, copy=False)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden_size)
    offsets = np.concatenate([[0], np.cumsum([a.shape[0] for a in present])]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), vectors, mask=mask)


def rows_table(
    rows: Sequence[Mapping[str, Any]],
    schema: Any,
    *,
    layers: Sequence[int],
    hidden_size: int,
    matrix: bool,
    dtype: np.dtype[Any],
) -> Any:
    """``rows`` (``answer_rows``'s: ``id``, ``choice``, the positions, ``layer_K`` arrays) as
    one Arrow table of ``schema``; a column of the schema that a row lacks is null there."""
    import pyarrow as pa

    layer_columns = {column_name(k) for k in layers}
    columns = [
        _layer_array(
            [r.get(f.name) for r in rows], hidden_size=hidden_size, matrix=matrix, dtype=dtype
        )
        if f.name in layer_columns
        else pa.array([r.get(f.name) for r in rows], f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


class DatasetWriter:
    """Rows in, Parquet parts out: a row group each ``row_group_rows`` rows (or
    :data:`ROW_GROUP_BYTES`), a new part each ``rows_per_file`` rows; :meth:`close` writes what
    is buffered and renames the part."""

    def __init__(
        self,
        directory: Location,
        *,
        layers: Sequence[int],
        hidden_size: int,
        matrix: bool,
        dtype: str,
        rows_per_file: int,
        row_group_rows: int,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory = directory
        self.layers = list(layers)
        self.hidden_size = hidden_size
        self.matrix = matrix
        self.dtype = np.dtype(np.float16 if dtype == "float16" else np.float32)
        self.rows_per_file = rows_per_file
        self.row_group_rows = row_group_rows
        self.schema = dataset_schema(
            self.layers, hidden_size=hidden_size, matrix=matrix, dtype=dtype, settings=settings
        )
        numbers = [
            int(found.group(1))
            for path in directory.iterdir()
            if (found := PART.fullmatch(path.name) or UNFINISHED_PART.fullmatch(path.name))
        ]
        self._next_part = 1 + max(numbers, default=-1)
        self._rows: list[dict[str, Any]] = []
        self._buffered_bytes = 0
        self._writer: Any = None
        self._file: IO[Any] | None = None
        self._temporary: Location | None = None
        self._part_rows = 0
        self.rows_written = 0
        self.parts_written: list[str] = []

    def add(self, row: dict[str, Any]) -> None:
        """One row: ``id``, ``choice``, the positions, and ``layer_K``: an array each."""
        self._rows.append(row)
        self._buffered_bytes += sum(row[column_name(k)].nbytes for k in self.layers)
        if len(self._rows) >= self.row_group_rows or self._buffered_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        self._buffered_bytes = 0
        while self._rows:
            if self._writer is None:
                self._open()
            room = self.rows_per_file - self._part_rows
            rows, self._rows = self._rows[:room], self._rows[room:]
            table = rows_table(
                rows,
                self.schema,
                layers=self.layers,
                hidden_size=self.hidden_size,
                matrix=self.matrix,
                dtype=self.dtype,
            )
            self._writer.write_table(table)
            self._part_rows += len(rows)
            self.rows_written += len(rows)
            if self._part_rows >= self.rows_per_file:
                self._close_part()

    def _open(self) -> None:
        import pyarrow.parquet as pq

        name = f"part-{self._next_part:05d}.parquet"
        self._next_part += 1
        self._temporary = self.directory / f".{name}.tmp"
        self._file = create_file(self._temporary, "wb")
        self._writer = pq.ParquetWriter(self._file, self.schema)
        self._part_rows = 0

    def _close_part(self) -> None:
        if self._writer is None or self._temporary is None or self._file is None:
            return
        self._writer.close()
        self._file.close()
        final = self.directory / self._temporary.name[1:].removesuffix(".tmp")
        replace(self._temporary, final)
        self.parts_written.append(final.name)
        self._writer = self._temporary = self._file = None

    def close(self) -> None:
        self._flush()
        self._close_part()
