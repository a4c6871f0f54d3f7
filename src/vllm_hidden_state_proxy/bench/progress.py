"""Progress on stderr: a redrawn bar on a terminal, a line per tenth of the work elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO

PREFIX = "[bench]"
BAR_WIDTH = 30


class Progress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty())

    def say(self, message: str) -> None:
        print(f"{PREFIX} {message}", file=self.stream, flush=True)

    def task(self, label: str, total: int) -> Task:
        return Task(self, label, total)


class Task:
    """Counts finished units of one phase; ``done()`` prints the final line with the time taken."""

    def __init__(self, progress: Progress, label: str, total: int) -> None:
        self.progress = progress
        self.label = label
        self.total = max(total, 1)
        self.count = 0
        self.started = time.monotonic()
        self._next_tenth = 1

    def advance(self, units: int = 1) -> None:
        self.count = min(self.count + units, self.total)
        if self.progress.interactive:
            self._draw()
            return
        tenth = self.count * 10 // self.total
        if tenth >= self._next_tenth and self.count < self.total:
            self._next_tenth = tenth + 1
            self.progress.say(f"{self.label}: {self.count}/{self.total} ({tenth * 10}%)")

    def _draw(self) -> None:
        filled = self.count * BAR_WIDTH // self.total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        stream = self.progress.stream
        stream.write(f"\r{PREFIX} {self.label} [{bar}] {self.count}/{self.total}")
        stream.flush()

    def done(self, note: str = "") -> None:
        elapsed = time.monotonic() - self.started
        if self.progress.interactive:
            self.progress.stream.write("\r\033[K")
        suffix = f"; {note}" if note else ""
        self.progress.say(f"{self.label}: {self.count}/{self.total} in {elapsed:.1f} s{suffix}")
