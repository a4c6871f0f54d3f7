"""Reading the corpus, streamed: one :class:`Input` (or :class:`InputProblem`) at a time from
JSONL or Parquet, never the whole file in memory.

An input is an object with an ``id`` (a string or an integer, kept as a string) and either
``messages`` (a chat) or ``prompt`` (a text, or a list of token ids); with ``--spans``, its
``spans`` too. What is not (bad JSON, no id, neither or both of ``messages`` and ``prompt``, an
id seen before) is an :class:`InputProblem`, which the run writes to the errors file. So is
what no JSON request can carry: ``NaN`` or a number out of a float's range, text that is not
UTF-8 (a lone surrogate), JSON nested deeper than Python reads, a Parquet value that is not
JSON (bytes, a timestamp), and a line longer than ``max_line_bytes`` (skipped in pieces, never
held whole).

A file that cannot be read as its format at all is a :class:`CorpusError`, found by
:func:`check_corpus` before anything is made.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from vllm_hidden_state_proxy.extract.storage import Location, StorePath, parquet_source

#: Parquet rows read at once.
_PARQUET_BATCH_ROWS = 1024
#: A JSONL line longer than this is refused by default (the proxy's default --max-body-size:
#: no request it takes is longer); a run gives the proxies' own (their ``max_body_bytes``).
DEFAULT_MAX_LINE_BYTES = 32 * 1024 * 1024
#: How much of a line too long is read at once while it is skipped.
_SKIP_BYTES = 1024 * 1024


class CorpusError(Exception):
    """INPUT cannot be read as its format (not a file, not Parquet): nothing is sent."""


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


def input_format(path: Location, given: str | None) -> str:
    if given is not None:
        return given
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def check_corpus(path: Location, fmt: str) -> None:
    """:class:`CorpusError` if ``path`` is not a readable file of its format (JSONL is not read
    here: it may be a pipe, ``<(zcat corpus.jsonl.gz)``, read once)."""
    if not path.exists():
        raise CorpusError(f"{path} does not exist")
    if path.is_dir():
        raise CorpusError(f"{path} is a directory, not a file of inputs")
    if not isinstance(path, StorePath) and not os.access(path, os.R_OK):
        raise CorpusError(f"{path} cannot be read (permission denied)")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            with parquet_source(path) as source:
                pq.ParquetFile(source)  # reads the footer: its schema and row groups
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise CorpusError(f"{path} cannot be read as Parquet: {exc}") from None


def _not_a_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range (Infinity): no JSON number")
    return value


class _NotJson(str):
    """A line's problem, and the id it names if Python's lenient reading finds one."""

    id: str | None = None


def _json(raw: bytes) -> Any:
    """One line's JSON, as a request can carry it again: no ``NaN`` or ``Infinity`` (Python
    reads them, a JSON body cannot hold them), nothing nested deeper than Python reads."""
    try:
        return json.loads(raw, parse_constant=_not_a_json_number, parse_float=_finite)
    except RecursionError:
        return _NotJson("not JSON: nested too deep")
    except ValueError as exc:
        problem = _NotJson(f"not JSON: {exc}")
    try:  # which input it was, for the errors file: read as Python would
        lenient = json.loads(raw)
    except (ValueError, RecursionError):
        return problem
    found = lenient.get("id") if isinstance(lenient, dict) else None
    if isinstance(found, (str, int)) and not isinstance(found, bool):
        problem.id = str(found)
    return problem


def _lines(source: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) for each line, ``None`` for one longer than ``limit`` (the rest of
    it read in pieces and dropped)."""
    line = 0
    while True:
        raw = source.readline(limit + 1)
        if not raw:
            return
        line += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield line, raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = source.readline(_SKIP_BYTES)
        yield line, None


def _not_json(value: Any, where: str) -> str | None:
    """Where in ``value`` (a Parquet row's field) something is not a JSON value, and what."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"`{where}` is {value}, not a JSON number"
    if isinstance(value, Mapping):
        for key, item in value.items():
            problem = _not_json(item, f"{where}.{key}")
            if problem is not None:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problem = _not_json(item, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    return f"`{where}` is a {type(value).__name__} ({value!r:.40}), not a JSON value"


def _records(path: Location, fmt: str, max_line_bytes: int) -> Iterator[tuple[int, Any]]:
    """(line, object or a problem string) for each line or row."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with parquet_source(path) as source:
            parquet = pq.ParquetFile(source)
            wanted = [
                c for c in ("id", "messages", "prompt", "spans") if c in parquet.schema_arrow.names
            ]
            line = 0
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted):
                for row in batch.to_pylist():
                    line += 1
                    yield line, {k: v for k, v in row.items() if v is not None}
        return
    with path.open("rb") as source:
        for line, raw in _lines(source, max_line_bytes):
            if raw is None:
                yield line, f"a line longer than {max_line_bytes} bytes (not read)"
            elif raw.strip():
                yield line, _json(raw)


def _checked(line: int, record: Any, spans: bool, parquet: bool) -> Input | InputProblem:
    if isinstance(record, str):
        found = record.id if isinstance(record, _NotJson) else None
        return InputProblem(line, found, str(record))
    if not isinstance(record, Mapping):
        return InputProblem(line, None, f"a JSON {type(record).__name__}, not an object")
    raw_id = record.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
        return InputProblem(line, None, "no `id` (a non-empty string or an integer)")
    id_ = str(raw_id)
    try:
        id_.encode("utf-8")
    except UnicodeEncodeError:
        return InputProblem(
            line, None, f"the `id` {id_!r:.60} is not UTF-8 text (a lone surrogate)"
        )
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
    if parquet:  # JSONL's values are JSON already (its reading refuses NaN and Infinity)
        for name, value in (("messages", messages), ("prompt", prompt), ("spans", span_list)):
            problem = _not_json(value, name)
            if problem is not None:
                return InputProblem(line, id_, problem)
    return Input(line, id_, messages, prompt, span_list)


def check_record(line: int, record: Mapping[str, Any], *, spans: bool) -> Input | InputProblem:
    """One record of plain values (a Parquet row's, a mapper's batch's) checked as extract
    checks each input (its values JSON a request can carry included)."""
    return _checked(line, record, spans, True)


def read_inputs(
    path: Location,
    fmt: str | None = None,
    *,
    spans: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Input | InputProblem]:
    """Each input of ``path`` in order; an id seen before is an :class:`InputProblem` (the
    first one counts), so nothing is sent twice. Only the ids are kept in memory."""
    seen: dict[str, int] = {}
    fmt = input_format(path, fmt)
    for line, record in _records(path, fmt, max_line_bytes):
        item = _checked(line, record, spans, fmt == "parquet")
        if isinstance(item, Input):
            first = seen.setdefault(item.id, line)
            if first != line:
                item = InputProblem(line, item.id, f"duplicate id (first at line {first})")
        yield item
