"""The run's counts, and the one line on stderr that shows them (done, total, rate, ETA)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO

from vllm_hidden_state_proxy.extract.storage import Location, parquet_source


@dataclass
class Counts:
    """What the run did with the inputs so far (the summary and the manifest's run)."""

    written: int = 0
    rows: int = 0
    skipped: int = 0
    failed: int = 0
    retries: int = 0
    seen: int = 0
    #: Each retry's cause: the status (``"503"``; ``"503 front server"`` for the front
    #: server's plain-text 503 at its connection bound), ``"connection"`` or ``"timeout"``.
    retries_by_cause: Counter[str] = field(default_factory=Counter)

    def retried(self, cause: str) -> None:
        self.retries += 1
        self.retries_by_cause[cause] += 1

    def retries_said(self) -> str:
        """``"5 retries (503: 2, connection: 3)"``, causes in order of their names."""
        causes = ", ".join(f"{c}: {n}" for c, n in sorted(self.retries_by_cause.items()))
        return f"{self.retries} retries" + (f" ({causes})" if causes else "")


def count_inputs(path: Location, fmt: str) -> int | None:
    """How many inputs there are, for the ETA: Parquet's metadata, or JSONL's lines (not of a
    pipe, which is read once)."""
    if not path.is_file():
        return None
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with parquet_source(path) as source:
                return int(pq.ParquetFile(source).metadata.num_rows)
        return _count_lines(path)
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError: not Parquet
        return None


def _count_lines(path: Location) -> int:
    """JSONL's lines that are not blank, read in pieces (a line may be longer than memory)."""
    count = 0
    blank = True  # the line so far holds only whitespace
    with path.open("rb") as source:
        while piece := source.read(1 << 20):
            lines = piece.split(b"\n")
            for line in lines[:-1]:
                count += not (blank and not line.strip())
                blank = True
            blank = blank and not lines[-1].strip()
    return count + (not blank)


class Progress:
    """One line on stderr, redrawn: done, total, rate, ETA."""

    def __init__(self, stream: IO[str], total: int | None, enabled: bool) -> None:
        self.stream, self.total, self.enabled = stream, total, enabled
        self.started = time.monotonic()
        self._drawn = 0.0

    def update(self, counts: Counts, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn < 0.25):
            return
        self._drawn = now
        elapsed = max(now - self.started, 1e-9)
        sent = counts.written + counts.failed
        rate = sent / elapsed
        text = f"\rextract: {counts.seen}" + (f"/{self.total}" if self.total else "")
        text += f" inputs, {counts.written} written, {counts.failed} failed, {rate:.1f}/s"
        if self.total and rate > 0:
            text += f", ETA {_duration((self.total - counts.seen) / rate)}"
        self.stream.write(text + "\x1b[K")
        self.stream.flush()

    def end(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
