"""One request's exchange with a proxy, bounded: its body encoded once (JSON a proxy can read,
no longer than it takes), sent, and its answer read whole within ``--timeout`` (connecting,
waiting, reading: the whole request, not each read) and ``--max-answer-size`` (counted decoded:
a gzip body of a few hundred KiB can decode to a GiB). What the input or its answer cannot get
past is a :class:`Refused`, that input's failure; a timeout is ``TimeoutError`` (the run
retries it, as a connection error)."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from vllm_hidden_state_proxy.client.answers import error_message

#: What the client says it reads: the encodings :func:`_decoder` bounds as it decodes.
ACCEPT_ENCODING = "gzip, deflate"


class Refused(Exception):
    """The input cannot be sent, or its answer read: its failure, with the reason."""

    def __init__(self, reason: str, status: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def encode_body(body: Mapping[str, Any], *, max_bytes: int) -> bytes:
    """``body`` as the JSON sent (as httpx would write it); :class:`Refused` for one no proxy
    takes: not JSON (``NaN``, text that is not UTF-8, what ``json`` does not write) or longer
    than ``max_bytes``."""
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        content = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        reason = f"the request body is not UTF-8 text (a lone surrogate?): {exc}"
        raise Refused(reason, None) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise Refused(f"the request body is not JSON: {exc}", None) from None
    if len(content) > max_bytes:
        raise Refused(
            f"the request body is {len(content)} bytes, more than the proxies take "
            f"(max_body_bytes {max_bytes}: serve --max-body-size)",
            None,
        )
    return content


@dataclass(frozen=True)
class Answer:
    """A proxy's answer, read whole: its status, headers and (decoded) body."""

    status: int
    headers: httpx.Headers
    body: bytes

    def _document(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            return None

    def error_reason(self) -> str:
        """The error's message (OpenAI's shape or vLLM's), else the start of the text."""
        message = error_message(self._document())
        if message is not None:
            return message
        return self.body[:500].decode("utf-8", "replace")

    def retry_cause(self) -> str:
        """The status, and ``front server`` for one whose body is no JSON error: the proxy's
        app answers in JSON; a plain-text 503 is uvicorn's at ``--max-client-connections``
        (or a gateway's in front of the proxy)."""
        plain = error_message(self._document()) is None
        return f"{self.status} front server" if plain else str(self.status)

    def retry_after(self) -> float | None:
        """``Retry-After`` in seconds, if it is a wait (finite, not negative; an HTTP date,
        ``nan`` or ``-1`` is not)."""
        value = self.headers.get("retry-after")
        try:
            seconds = float(value) if value is not None else math.nan
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _decoder(encoding: str) -> Any:
    """A zlib decoder for ``encoding`` (``None``: none), or :class:`Refused`."""
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib, by the header
    raise Refused(
        f"the answer's content-encoding {encoding!r} is not one extract reads "
        f"({ACCEPT_ENCODING}, which it asks for)",
        200,
    )


async def _read(response: httpx.Response, max_bytes: int) -> bytes:
    """The body, decoded as it arrives, never more than ``max_bytes`` of it: a decoder gives
    at most what is left of the bound from each piece."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    decoder = _decoder(encoding)
    parts: list[bytes] = []
    size = 0

    def take(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > max_bytes:
            raise Refused(
                f"the answer is longer than --max-answer-size ({max_bytes} bytes"
                + (f", decoded from {encoding}" if decoder is not None else "")
                + ")",
                response.status_code,
            )
        parts.append(data)

    try:
        async for raw in response.aiter_raw():
            if decoder is None:
                take(raw)
                continue
            data = raw
            while data:
                take(decoder.decompress(data, max_bytes - size + 1))
                data = decoder.unconsumed_tail
        if decoder is not None:
            take(decoder.flush())
    except zlib.error as exc:
        raise Refused(f"the answer's {encoding} body does not decode ({exc})", 200) from None
    return b"".join(parts)


async def _exchange(client: httpx.AsyncClient, url: str, content: bytes, max_bytes: int) -> Answer:
    headers = {"content-type": "application/json", "accept-encoding": ACCEPT_ENCODING}
    async with client.stream("POST", url, content=content, headers=headers) as response:
        body = await _read(response, max_bytes)
        return Answer(response.status_code, response.headers, body)


async def exchange(
    client: httpx.AsyncClient, url: str, content: bytes, *, max_bytes: int, timeout: float
) -> Answer:
    """POST ``content`` to ``url``; the answer, read whole within ``timeout`` seconds and
    ``max_bytes`` decoded. Raises ``httpx.TransportError`` (a connection that failed),
    ``TimeoutError`` and :class:`Refused`.

    The deadline is anyio's cancel scope, not ``asyncio.wait_for``: on Python 3.10 and 3.11 a
    ``wait_for`` cancelled in the loop turn its inner task finished returns the result and
    swallows the cancellation, so a Ctrl-C that came as an answer arrived let the worker send
    its next request (and hang there on a stuck server)."""
    with anyio.fail_after(timeout):
        return await _exchange(client, url, content, max_bytes)
