"""The dataset's writes on a thread of their own: building Arrow arrays and writing Parquet row
groups (milliseconds each) never hold the event loop that sends and reads.

Rows go to the writer in the order given, one batch at a time, on one thread; at most
:data:`MOST_PENDING` batches wait (the senders wait for the oldest past that). A write that
fails (a full disk) is raised to the next sender that adds rows, and by :meth:`close`."""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_hidden_state_proxy.extract.dataset import DatasetWriter

MOST_PENDING = 16


class WriteBehind:
    def __init__(self, writer: DatasetWriter) -> None:
        self.writer = writer
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="extract-write")
        self._pending: deque[Future[None]] = deque()

    def _write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.writer.add(row)

    async def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue ``rows``; raises what an earlier write raised."""
        pending = self._pending
        while True:
            while pending and pending[0].done():
                pending.popleft().result()
            if len(pending) < MOST_PENDING:
                break
            # Several senders may wait for the same write: each looks again once it is done
            # (never takes a write not done off the queue, never blocks the loop on one).
            # Shielded: a sender cancelled while it waits (an interrupt) must not cancel the
            # write it waits for, which asyncio's wrap_future would do; those rows are kept.
            await asyncio.shield(asyncio.wrap_future(pending[0]))
        pending.append(self._thread.submit(self._write, rows))

    def close(self) -> None:
        """Every queued write, then the writer's :meth:`~DatasetWriter.close` (on its thread);
        raises the first error among them (the part stays ``.tmp``)."""
        try:
            self._thread.submit(self._close).result()
        finally:
            self._thread.shutdown(wait=True)

    def _close(self) -> None:
        pending, self._pending = self._pending, deque()
        try:
            for future in pending:  # done: the one thread ran them in order before this
                future.result()
        finally:
            self.writer.close()
