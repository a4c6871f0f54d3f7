"""The dataset's write thread: senders waiting for it never block the event loop, and an
interrupt while they wait loses no rows."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, cast

from vllm_hidden_state_proxy.extract.dataset import DatasetWriter
from vllm_hidden_state_proxy.extract.write_behind import MOST_PENDING, WriteBehind


class HeldWriter:
    """Takes a row per permit the test releases; ``starved`` if one never came."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.rows: list[dict[str, Any]] = []
        self.starved = False
        self.closed = False

    def add(self, row: dict[str, Any]) -> None:
        if not self.permits.acquire(timeout=60):  # only a blocked event loop leaves it waiting
            self.starved = True
        self.rows.append(row)

    def close(self) -> None:
        self.closed = True


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_senders_waiting_for_one_write_neither_block_the_loop_nor_lose_rows_when_cancelled() -> (
    None
):
    writer = HeldWriter()
    behind = WriteBehind(cast(DatasetWriter, writer))

    async def main() -> None:
        for i in range(MOST_PENDING):
            await behind.add([{"id": i}])
        first = asyncio.create_task(behind.add([{"id": "first"}]))
        second = asyncio.create_task(behind.add([{"id": "second"}]))
        await settled()
        assert not first.done() and not second.done()  # both wait for the oldest write
        writer.permits.release()  # the oldest write ends; the next one starts and holds
        await asyncio.wait({first})  # one of them queued its rows...
        await settled()
        # ...and the other waits for the next write without holding the loop (a sender that
        # took a running write off the queue and blocked on it held the loop until it ended)
        assert not second.done()
        second.cancel()  # what an interrupt does to a sender
        with contextlib.suppress(asyncio.CancelledError):
            await second

    asyncio.run(main())
    for _ in range(MOST_PENDING + 1):
        writer.permits.release()
    behind.close()  # raised CancelledError when a cancelled wait cancelled a queued write
    assert not writer.starved
    assert [row["id"] for row in writer.rows] == [*range(MOST_PENDING), "first"]
    assert writer.closed
