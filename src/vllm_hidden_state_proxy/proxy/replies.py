"""Sending vLLM's reply to the client: as vLLM wrote it (:func:`send_unchanged`), or, where it
carries counted vectors, within a deadline: the JSON reply with them joined in (whole when
small, in pieces when its matrices are large), an embeddings response, a stream's event with
vectors.

A reply whose matrices hold at least :data:`.vectors.memory.OFF_LOOP_BYTES` is not built
whole: vLLM's completion with the vectors' fields is written with a marker where each
matrix's ``"data"`` goes, and the client gets the text between the markers as it is and each
matrix encoded a piece at a time (about 1 MiB of its rows per piece, base64 or float lists), in
a thread, off the event loop. The memory it takes is one piece being encoded and one being
sent (uvicorn's send waits while the socket's buffer is above its high-water mark), counted
against the request's share of the vector memory (:mod:`.vectors.memory`). The response has no
``content-length`` (HTTP/1.1 chunked).

A stream's (SSE) event that carries large matrices is encoded whole, in a thread, counted
against the request's memory (:func:`encoded_off_loop`).

Every send of such a response must complete within ``--send-timeout``, and all of its sends
within ``--send-timeout`` plus its size at :data:`MIN_SEND_RATE` (:class:`SendDeadline`): a
client that stops reading, or reads too slowly, has its connection cut (uvicorn's transport
aborted, which frees what it buffered) and the request's memory is given back. A final empty
send waits for the socket's buffer to drain below its high-water mark, so a response is not
left in the buffer of a client that never reads. In a stream (SSE), only the sends of events that
carry vectors are bounded (:func:`send_counted_events`): the rest is relayed as vLLM sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import orjson
import pybase64
from starlette.types import Send

import vllm_hidden_state_proxy.proxy.vectors.memory as vector_memory
from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.errors import reply_not_reencodable
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.types import RawHeaders
from vllm_hidden_state_proxy.proxy.vectors.encoding import Matrix, dump_json, float32_view
from vllm_hidden_state_proxy.proxy.vectors.fields import with_kv_fields
from vllm_hidden_state_proxy.proxy.vectors.memory import OFF_LOOP_BYTES, off_loop_limiter
from vllm_hidden_state_proxy.wanted_vectors import as_dtype

log = logging.getLogger("vllm_hidden_state_proxy.proxy")

#: Upstream headers not copied onto a rebuilt JSON response (the proxy sets its own).
REBUILT_DROP = frozenset({b"content-length", b"content-type", b"content-encoding"})

#: float32 values per base64 piece: a multiple of 3, so that pieces join into one base64 text
#: whatever the dtype (4 or 2 bytes a value); 1 MiB of float32 rows.
BASE64_VALUES = 3 * 87_381
#: float32 values per piece of float lists (about 0.8 MiB of text).
FLOAT_VALUES = 64 * 1024
#: Bytes a piece's text may take: base64 of 1 MiB, or 64 Ki floats of up to 15 characters.
PIECE_BYTES = max(4 * BASE64_VALUES * 4 // 3 + 4, FLOAT_VALUES * 16 + 16)
#: A body up to this size is sent in one message and may stay in the socket's buffer after the
#: handler ends (as any small response); a larger one is followed by an empty final send that
#: waits for the buffer to drain.
SMALL_BODY = 64 * 1024


#: The slowest a client may take a response that carries counted vectors, on average, past its
#: first ``--send-timeout``: 1 MiB/s (8 Mbit/s; a 64 MiB float32 matrix, 85 MiB as base64, gets
#: 30 + 85 s). Slower clients would hold the process's --vectors-budget for long: 12 readers of
#: a 64 MiB matrix at a piece per 29 s held 768 MiB for 40 min with only the per-send bound.
MIN_SEND_RATE = 1 << 20


class ClientTooSlow(Exception):
    """The client did not take its response in time (:class:`SendDeadline`)."""


def matrix_pieces(matrix: Matrix) -> Iterator[Callable[[], bytes]]:
    """The JSON text of ``matrix``'s ``"data"``, as functions that each encode one piece."""
    rows, hidden = matrix.rows, matrix.hidden_size
    values = float32_view(rows)
    if matrix.fmt == "base64":
        step = BASE64_VALUES
        total = values.size

        def base64_piece(start: int) -> Callable[[], bytes]:
            def encode() -> bytes:
                part = memoryview(rows)[4 * start : 4 * min(start + step, total)]
                text = pybase64.b64encode(as_dtype(part, matrix.dtype))
                opening = b'"' if start == 0 else b""
                closing = b'"' if start + step >= total else b""
                return opening + text + closing

            return encode

        if total == 0:
            yield lambda: b'""'
        for start in range(0, total, step):
            yield base64_piece(start)
        return
    table = values.reshape(matrix.count, hidden)
    per_piece = max(1, FLOAT_VALUES // max(hidden, 1))

    def float_piece(start: int) -> Callable[[], bytes]:
        def encode() -> bytes:
            text = orjson.dumps(table[start : start + per_piece], option=orjson.OPT_SERIALIZE_NUMPY)
            opening = b"[" if start == 0 else b","
            closing = b"]" if start + per_piece >= matrix.count else b""
            return opening + text[1:-1] + closing

        return encode

    if matrix.count == 0:
        yield lambda: b"[]"
    for start in range(0, matrix.count, per_piece):
        yield float_piece(start)


def _without_matrices(document: Any) -> tuple[bytes, list[Matrix], bytes]:
    """``document`` as JSON with a marker in place of each matrix's data; the matrices in
    order; the marker's pattern."""
    matrices: list[Matrix] = []
    marker = secrets.token_hex(16)

    def mark(value: Any) -> Any:
        if isinstance(value, Matrix):
            matrices.append(value)
            return f"{marker}:{len(matrices) - 1}"
        raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")

    text = orjson.dumps(document, default=mark, option=orjson.OPT_SERIALIZE_NUMPY)
    return text, matrices, marker.encode("ascii")


#: JSON text bytes per float32 byte written as a float list, at most (~15 characters a value).
FLOAT_TEXT = 4


def _vectors_size(document: Any) -> tuple[int, int]:
    """Bytes of the matrices' rows in ``document`` (a dict of fields, lists, matrices), and
    the JSON text that its vectors and matrices take, at most."""
    stack = [document]
    size = text = 0
    while stack:
        value = stack.pop()
        if isinstance(value, Matrix):
            size += value.size
            if value.fmt == "base64":
                encoded = value.size if value.dtype == "float32" else value.size // 2
                text += 4 * (encoded // 3 + 1)
            else:
                text += FLOAT_TEXT * value.size
        elif isinstance(value, str):
            text += len(value)
        elif isinstance(value, np.ndarray):
            text += FLOAT_TEXT * value.nbytes
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return size, text


async def send_joined(
    send: Send, headers: RawHeaders, completion: dict[str, Any], fields: dict[str, Any]
) -> None:
    """vLLM's 200 JSON reply with ``fields`` joined into its ``kv_transfer_params``, with
    vLLM's headers (minus hop-by-hop and the ones rebuilt here)."""
    own = downstream_response_headers(headers, drop=REBUILT_DROP)
    await send_json_reply(send, own, with_kv_fields(completion, fields), fields)


async def send_json_reply(
    send: Send, headers: RawHeaders, document: dict[str, Any], fields: Any
) -> None:
    """Send ``document`` (vLLM's completion with ``fields`` joined in) as a 200 JSON response:
    whole, or in pieces if the matrices of ``fields`` are large (see the module docstring).
    Raises ``ProxyError`` before any byte is sent (the body cannot be written, or would take
    the request over its memory)."""
    matrices_size, text_size = _vectors_size(fields)
    if matrices_size < OFF_LOOP_BYTES:
        try:
            if text_size < OFF_LOOP_BYTES:
                body = dump_json(document)
            else:  # many vectors (a long prompt list): written in a thread
                vector_memory.take(text_size)
                body = await anyio.to_thread.run_sync(
                    dump_json, document, limiter=off_loop_limiter()
                )
                vector_memory.give_back(text_size)
        except orjson.JSONEncodeError as exc:
            raise reply_not_reencodable(exc) from exc
        vector_memory.take(len(body))
        start_headers = [(b"content-type", b"application/json")]
        start_headers.append((b"content-length", str(len(body)).encode("ascii")))
        pieces: list[bytes | Callable[[], bytes]] = [body]
        size = len(body)
    else:
        try:
            text, matrices, marker = _without_matrices(document)
        except orjson.JSONEncodeError as exc:
            raise reply_not_reencodable(exc) from exc
        vector_memory.take(len(text) + 2 * PIECE_BYTES)
        size = len(text) + text_size  # the matrices' text at most
        start_headers = [(b"content-type", b"application/json")]
        pieces = []
        parts = re.split(b'"' + re.escape(marker) + rb':(\d+)"', text)
        for index, part in enumerate(parts):
            if index % 2 == 0:
                pieces.append(part)
            else:
                pieces.extend(matrix_pieces(matrices[int(part)]))
    await _sent_in_time(
        SendDeadline(size),
        lambda deadline: _send_pieces(send, 200, start_headers + list(headers), pieces, deadline),
    )


async def send_counted_whole(
    send: Send, upstream_headers: RawHeaders, body: bytes, content_type: bytes
) -> None:
    """A complete 200 response whose ``body`` holds counted vectors (the embeddings' list), with
    vLLM's headers, within the :class:`SendDeadline` for its size: a client too slow is cut."""
    headers: RawHeaders = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode("ascii")),
        *downstream_response_headers(upstream_headers, drop=REBUILT_DROP),
    ]
    await _sent_in_time(
        SendDeadline(len(body)),
        lambda deadline: _send_pieces(send, 200, headers, [body], deadline),
    )


async def send_counted_events(send: Send, events: bytes, more: bool = True) -> bool:
    """Send a stream's ``events`` that carry counted vectors, then wait for the socket's buffer
    to drain below its high-water mark, within the :class:`SendDeadline` for their size; False:
    the client was too slow and is cut (the stream is over)."""

    async def sends(deadline: SendDeadline) -> None:
        await _within(send, deadline, _body(events, True))
        await _within(send, deadline, _body(b"", more))  # waits for the drain (see above)

    return await _sent_in_time(SendDeadline(len(events)), sends)


def _body(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": body, "more_body": more}


def _now() -> float:
    """The event loop's clock (what ``anyio.current_time`` reads, without its lookups)."""
    return asyncio.get_running_loop().time()


if sys.version_info >= (3, 11):
    # A timer on the loop: ~8 µs a use where anyio's cancel scope costs ~19 (issue #46).
    _bounded = asyncio.timeout
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def _bounded(seconds: float) -> AsyncIterator[None]:
        with anyio.fail_after(seconds):
            yield


class SendDeadline:
    """When the sends of one response (or event) that carries counted vectors must be done:
    each within ``--send-timeout``, all of them within ``--send-timeout`` plus its ``size``
    at :data:`MIN_SEND_RATE`. No bound outside a request or without ``--send-timeout``."""

    def __init__(self, size: int) -> None:
        share = vector_memory.current()
        self.share = share
        self.each = None if share is None else share.send_timeout
        self.total = None if self.each is None else self.each + size / MIN_SEND_RATE
        self._end = None if self.total is None else _now() + self.total

    def left(self) -> float | None:
        """Seconds the next send may take (``None``: no bound); ClientTooSlow once past the
        end."""
        if self.each is None or self._end is None:
            return None
        left = min(self.each, self._end - _now())
        if left <= 0:
            raise ClientTooSlow
        return left


async def _sent_in_time(
    deadline: SendDeadline, sends: Callable[[SendDeadline], Awaitable[None]]
) -> bool:
    """Run ``sends``; if the client is too slow for ``deadline``, cut its connection (which
    drops what uvicorn buffered for it) and return False."""
    try:
        await sends(deadline)
    except ClientTooSlow:
        log.info(
            "cut a client that did not take its answer in time: each send within %s s "
            "(--send-timeout), all of it within %.0f s (--send-timeout + its size at %d KiB/s)",
            deadline.each,
            deadline.total,
            MIN_SEND_RATE // 1024,
        )
        if deadline.share is not None:
            deadline.share.cut_off()
            for _ in range(3):  # the transport's connection_lost runs on the next iterations
                await asyncio.sleep(0)
        return False
    return True


async def _send_pieces(
    send: Send,
    status: int,
    headers: RawHeaders,
    pieces: list[bytes | Callable[[], bytes]],
    deadline: SendDeadline,
) -> None:
    start = {"type": "http.response.start", "status": status, "headers": headers}
    if len(pieces) == 1 and isinstance(pieces[0], bytes) and len(pieces[0]) <= SMALL_BODY:
        # Head and body under one bound: a cancel scope costs ~8 µs (issue #46).
        await _within(send, deadline, start, _body(pieces[0], False))
        return
    await _within(send, deadline, start)
    for piece in pieces:
        if callable(piece):
            piece = await anyio.to_thread.run_sync(piece, limiter=off_loop_limiter())
        if piece:
            await _within(send, deadline, _body(piece, True))
    # Waits for the socket's buffer to drain below its high-water mark (see above).
    await _within(send, deadline, _body(b"", False))


async def _within(send: Send, deadline: SendDeadline, *messages: dict[str, Any]) -> None:
    """Send ``messages``, all of them within the deadline's next bound."""
    timeout = deadline.left()
    if timeout is None:
        for message in messages:
            await send(message)
        return
    try:
        async with _bounded(timeout):  # no task per send, as wait_for makes
            for message in messages:
                await send(message)
    except TimeoutError:
        raise ClientTooSlow from None


async def encoded_off_loop(encode: Callable[[], bytes], fields: Any) -> bytes:
    """``encode()``: a stream's event (or a whole response) with ``fields`` in it. When their
    JSON text is large, in a thread, after counting that text against the request's memory
    for vectors (held until the request ends: such an event is sent whole)."""
    _, text_size = _vectors_size(fields)
    if text_size < OFF_LOOP_BYTES:
        return encode()
    vector_memory.take(text_size)
    return await anyio.to_thread.run_sync(encode, limiter=off_loop_limiter())


async def send_whole(
    send: Send, status: int, upstream_headers: RawHeaders, body: bytes, content_type: bytes
) -> None:
    """A complete response with vLLM's headers (minus hop-by-hop and the ones rebuilt here)."""
    headers = downstream_response_headers(upstream_headers, drop=REBUILT_DROP)
    await send_response(send, status, body, content_type, headers)


async def send_unchanged(send: Send, status: int, headers: RawHeaders, content: bytes) -> None:
    """A complete reply as vLLM wrote it (status, content type, body)."""
    content_type = b"application/json"
    for name, value in headers:
        if name.lower() == b"content-type":
            content_type = value
            break
    await send_whole(send, status, headers, content, content_type)
