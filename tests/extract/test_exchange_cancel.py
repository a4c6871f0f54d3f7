"""A Ctrl-C that lands as an answer arrives still stops extract's worker.

On Python 3.10 and 3.11 ``asyncio.wait_for`` returns its inner task's result when it is cancelled
in the loop turn that task finished, and the cancellation is lost: extract's worker then took its
next batch and, with a server that had stopped answering, waited for it forever (seen as an
interrupted run that never exited, about one run in twenty). ``exchange`` now bounds the request
with anyio's cancel scope; this test lands the cancel in exactly that turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from vllm_hidden_state_proxy.extract import exchange as exchange_module
from vllm_hidden_state_proxy.extract.exchange import Answer, exchange


def test_a_cancel_in_the_turn_the_answer_arrives_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accepted: list[bool] = []

    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[str]] = []

        async def answered(*_: Any) -> Answer:
            # Queued now, this runs before the callbacks of whatever awaits this coroutine's
            # end, and queues the cancel behind them: it lands after a wait_for's inner task
            # has finished and released its waiter, before the outer task has woken.
            def cancel_soon() -> None:
                loop.call_soon(lambda: accepted.append(tasks[0].cancel()))

            loop.call_soon(cancel_soon)
            return Answer(200, httpx.Headers(), b"{}")

        monkeypatch.setattr(exchange_module, "_exchange", answered)

        async def send() -> str:
            async with httpx.AsyncClient() as client:
                await exchange(client, "http://unused", b"{}", max_bytes=1 << 20, timeout=30)
            # The worker's next step: never reached once the cancel was accepted.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return "went on"

        tasks.append(asyncio.ensure_future(send()))
        try:
            return await tasks[0]
        except asyncio.CancelledError:
            return "cancelled"

    outcome = asyncio.run(scenario())
    if accepted == [True]:  # the task took the cancel: it must end cancelled
        assert outcome == "cancelled"
    else:  # it had already ended when the cancel came
        assert accepted == [False] and outcome == "went on"
