"""Raw ASGI plumbing: bounded body reading (size, time, the process's total of buffered
bodies), whole responses, disconnect watch. (The ASGI type aliases are Starlette's.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from starlette.types import Receive, Scope, Send

from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    body_budget_exhausted,
    body_timeout,
    body_too_large,
)
from vllm_hidden_state_proxy.proxy.types import RawHeaders

_CLOSE: RawHeaders = [(b"connection", b"close")]


class ClientDisconnected(Exception):
    """The client went away while the proxy was still reading its request."""


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit."""


class BodyTimeout(Exception):
    """The request body did not arrive complete in time."""


class BudgetExhausted(Exception):
    """The request body would take this process over its total of buffered body bytes."""


class BodyBudget:
    """The request-body bytes one proxy process buffers at once, over all its requests.

    Each request takes its share through a :class:`BodyShare` as its bytes arrive (not as
    declared: a client declaring 32 MiB and sending nothing would hold the budget for free),
    and gives it back when the request ends: the body stays in memory while the exchange with
    vLLM runs, not only while it is read.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0

    def share(self) -> BodyShare:
        return BodyShare(self)


class BodyShare:
    """One request's part of a :class:`BodyBudget`; a context manager that gives it back."""

    __slots__ = ("budget", "taken")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.taken = 0

    def check(self, size: int) -> None:
        """``BudgetExhausted`` if ``size`` more bytes would not fit now (nothing is taken)."""
        if self.budget.held + size > self.budget.total:
            raise BudgetExhausted

    def take(self, size: int) -> None:
        self.check(size)
        self.budget.held += size
        self.taken += size

    def __enter__(self) -> BodyShare:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.budget.held -= self.taken
        self.taken = 0


def header_value(scope: Scope, name: bytes) -> bytes | None:
    """First value of a request header (``name`` lower-case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(
    scope: Scope,
    receive: Receive,
    limit: int,
    share: BodyShare | None = None,
    timeout: float | None = None,
) -> bytes:
    """The full request body; raises ``BodyTooLarge`` past ``limit`` bytes, ``BudgetExhausted``
    when ``share`` cannot take it, ``BodyTimeout`` when it is not complete within ``timeout``
    seconds (all of it, not per chunk: a client sending a byte now and then is cut off too).

    A declared ``Content-Length`` over the limit, or over what is left of the budget, is
    refused before reading anything; the body takes its share of the budget chunk by chunk.
    """
    declared = header_value(scope, b"content-length")
    # (Any number of digits beyond the limit's is over it; int() of thousands of digits raises.)
    if declared is not None and declared.isdigit():
        if len(declared) > len(str(limit)) or int(declared) > limit:
            raise BodyTooLarge
        if share is not None:
            share.check(int(declared))
    if timeout is None:
        return await _read_chunks(receive, limit, share)
    # One timer that cancels this task, rather than a wait_for task per chunk: every POST
    # pays for it.
    task = asyncio.current_task()
    if task is None:  # pragma: no cover - always inside the server's request task
        return await _read_chunks(receive, limit, share)
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await _read_chunks(receive, limit, share)
    except asyncio.CancelledError:
        if not expired:
            raise  # not ours: the server is shutting down
        _uncancel(task)
        raise BodyTimeout from None
    finally:
        timer.cancel()


async def _read_chunks(receive: Receive, limit: int, share: BodyShare | None) -> bytes:
    """The body's chunks, joined, each taken from ``share`` as it arrives."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            if share is not None:
                share.take(len(chunk))
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


async def send_response(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    extra_headers: RawHeaders | None = None,
) -> None:
    """Send a complete, non-streaming response."""
    headers: RawHeaders = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode("ascii")),
    ]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ProxyError) -> None:
    await send_response(send, error.status, error.body(), b"application/json")


async def receive_body(
    scope: Scope,
    receive: Receive,
    send: Send,
    limit: int,
    share: BodyShare | None = None,
    timeout: float | None = None,
) -> bytes | None:
    """The request body, or ``None`` if the request is already answered (413, 503 over the
    budget, 408 too slow) or abandoned."""
    try:
        return await read_body(scope, receive, limit, share, timeout)
    except BodyTooLarge:
        await send_error(send, body_too_large(limit))
    except BudgetExhausted:
        await send_error(send, body_budget_exhausted())
    except BodyTimeout:
        # The connection goes with it: the rest of a slow body is not worth waiting for.
        error = body_timeout(timeout or 0.0)
        await send_response(send, error.status, error.body(), b"application/json", _CLOSE)
    except ClientDisconnected:
        pass
    return None


async def run_until_disconnect(receive: Receive, exchange: Awaitable[None]) -> bool:
    """Await ``exchange`` while watching ``receive`` for ``http.disconnect``.

    Must be called after the request body has been read completely. If the client disconnects
    first, ``exchange`` is cancelled (its ``finally`` blocks close the upstream response).
    Returns ``True`` if the exchange ran to completion.

    Plain asyncio, not an anyio task group: this runs for every request, and a task group
    costs several cancel scopes per request for what one watcher task and ``cancel()`` do.
    """
    task = asyncio.current_task()
    if task is None:  # pragma: no cover - always inside uvicorn's request task
        await exchange
        return True
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await exchange
    except asyncio.CancelledError:
        if not disconnected:
            raise  # not ours: the server is shutting down
        _uncancel(task)
        return False
    finally:
        watcher.cancel()
    return True


def _uncancel(task: asyncio.Task[Any]) -> None:
    """Take back a cancellation this module made (a timer's or a disconnect's), so the task
    runs on as if uncancelled (Python >= 3.11; earlier ones keep no count)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()
