"""Reading the corpus, streamed: one :class:`Input` (or :class:`InputProblem`) at a time from
JSONL or Parquet, never the whole file in memory.

An input is an object with an ``id`` (a string or an integer, kept as a string) and either
``messages`` (a chat) or ``prompt`` (a text, or a list of token ids); with ``--spans``, its
``spans`` too. What is not (bad JSON, no id, neither or both of ``messages`` and ``prompt``, an
id seen before) is an :class:`InputProblem`, which the run writes to the errors file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Parquet rows read at once.
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Input:
    """One input: ``line`` is its 1-based line (JSONL) or row (Parquet) number."""

    line: int
    id: str
    messages: list[Any] | None
    prompt: str | list[int] | None
    spans: list[list[int]] | None = None


@dataclass(frozen=True)
class InputProblem:
    """An input that cannot be sent, and why."""

    line: int
    id: str | None
    reason: str


def input_format(path: Path, given: str | None) -> str:
    if given is not None:
        return given
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def _records(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """(line, object or a problem string) for each line or row."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        wanted = [
            c for c in ("id", "messages", "prompt", "spans") if c in parquet.schema_arrow.names
        ]
        line = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted):
            for row in batch.to_pylist():
                line += 1
                yield line, {k: v for k, v in row.items() if v is not None}
        return
    with path.open("rb") as lines:
        for line, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                yield line, json.loads(raw)
            except ValueError as exc:
                yield line, f"not JSON: {exc}"


def _checked(line: int, record: Any, spans: bool) -> Input | InputProblem:
    if isinstance(record, str):
        return InputProblem(line, None, record)
    if not isinstance(record, Mapping):
        return InputProblem(line, None, f"a JSON {type(record).__name__}, not an object")
    raw_id = record.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
        return InputProblem(line, None, "no `id` (a non-empty string or an integer)")
    id_ = str(raw_id)
    messages, prompt = record.get("messages"), record.get("prompt")
    if (messages is None) == (prompt is None):
        return InputProblem(line, id_, "needs exactly one of `messages` and `prompt`")
    if messages is not None and (not isinstance(messages, list) or not messages):
        return InputProblem(line, id_, "`messages` is not a non-empty list")
    if prompt is not None and not (
        (isinstance(prompt, str) and prompt)
        or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
    ):
        return InputProblem(line, id_, "`prompt` is not a non-empty text or list of token ids")
    span_list = record.get("spans")
    if spans and span_list is None:
        return InputProblem(line, id_, "no `spans` (--spans asks every input for them)")
    if not spans and span_list is not None:
        return InputProblem(line, id_, "`spans` given without --spans")
    return Input(line, id_, messages, prompt, span_list)


def read_inputs(
    path: Path, fmt: str | None = None, *, spans: bool = False
) -> Iterator[Input | InputProblem]:
    """Each input of ``path`` in order; an id seen before is an :class:`InputProblem` (the
    first one counts), so nothing is sent twice. Only the ids are kept in memory."""
    seen: dict[str, int] = {}
    for line, record in _records(path, input_format(path, fmt)):
        item = _checked(line, record, spans)
        if isinstance(item, Input):
            first = seen.setdefault(item.id, line)
            if first != line:
                item = InputProblem(line, item.id, f"duplicate id (first at line {first})")
        yield item
