"""The run's counts, and the one line on stderr that shows them (done, total, rate, ETA)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass
class Counts:
    """What the run did with the inputs so far (the summary and the manifest's run)."""

    written: int = 0
    rows: int = 0
    skipped: int = 0
    failed: int = 0
    retries: int = 0
    seen: int = 0


def count_inputs(path: Path, fmt: str) -> int | None:
    """How many inputs there are, for the ETA: Parquet's metadata, or JSONL's lines."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        count = 0
        with path.open("rb") as source:
            for line in source:
                count += bool(line.strip())
        return count
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError: not Parquet
        return None


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
