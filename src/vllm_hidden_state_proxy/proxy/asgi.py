"""Raw ASGI plumbing: typed aliases, bounded body reading, whole responses, disconnect watch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_hidden_state_proxy.proxy.errors import ProxyError, body_too_large

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client went away while the proxy was still reading its request."""


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit."""


def header_value(scope: Scope, name: bytes) -> bytes | None:
    """First value of a request header (``name`` lower-case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The full request body; raises ``BodyTooLarge`` past ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before reading anything.
    """
    declared = header_value(scope, b"content-length")
    # (Any number of digits beyond the limit's is over it; int() of thousands of digits raises.)
    if (
        declared is not None
        and declared.isdigit()
        and (len(declared) > len(str(limit)) or int(declared) > limit)
    ):
        raise BodyTooLarge
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


async def receive_body(scope: Scope, receive: Receive, send: Send, limit: int) -> bytes | None:
    """The request body, or ``None`` if the request is already answered (413) or abandoned."""
    try:
        return await read_body(scope, receive, limit)
    except BodyTooLarge:
        await send_error(send, body_too_large(limit))
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
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
        if uncancel is not None:
            uncancel()
        return False
    finally:
        watcher.cancel()
    return True
