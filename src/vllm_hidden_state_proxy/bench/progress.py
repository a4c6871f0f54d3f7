"""Progress on stderr: a line when a phase starts, every tenth of its work, and when it ends."""

from __future__ import annotations

import sys
import time
from typing import TextIO

PREFIX = "[bench]"


class Progress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr

    def say(self, message: str) -> None:
        print(f"{PREFIX} {message}", file=self.stream, flush=True)

    def task(self, label: str, total: int) -> Task:
        return Task(self, label, total)


class Task:
    """Counts finished units of one phase; ``done()`` says how long it took."""

    def __init__(self, progress: Progress, label: str, total: int) -> None:
        self.progress = progress
        self.label = label
        self.total = max(total, 1)
        self.count = 0
        self.started = time.monotonic()
        self._next_tenth = 1

    def advance(self, units: int = 1) -> None:
        self.count = min(self.count + units, self.total)
        tenth = self.count * 10 // self.total
        if tenth >= self._next_tenth and self.count < self.total:
            self._next_tenth = tenth + 1
            self.progress.say(f"{self.label}: {self.count}/{self.total} ({tenth * 10}%)")

    def done(self) -> None:
        elapsed = time.monotonic() - self.started
        self.progress.say(f"{self.label}: {self.count}/{self.total} in {elapsed:.1f} s")
