"""What the three stream rewriters share (:mod:`.prompt_vectors`, :mod:`.answer_vectors`,
:mod:`.responses`): a flagged stream held until the vectors can join it, within
``--max-answer-size`` (:func:`hold_until`: nothing has been sent yet, so a failure is still a
proper error response), the head of the rewritten stream (:func:`send_head`: vLLM's status and
headers, less its ``content-length``), and a changed chunk written back
(:func:`encoded_chunk`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx
import orjson
from starlette.types import Send

from vllm_hidden_state_proxy.proxy.errors import (
    chunk_not_reencodable,
    stream_held_too_long,
)
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.upstream import transport_error
from vllm_hidden_state_proxy.proxy.vectors.encoding import dump_json

#: The streamed body changes length where the vectors are joined in.
STREAM_DROP = frozenset({b"content-length"})


T = TypeVar("T")


async def hold_until(
    state: ProxyState,
    chunks: AsyncIterator[bytes],
    scan: Callable[[bytearray], T | None],
    missing: str,
) -> tuple[bytearray, T | None]:
    """Buffer a flagged stream until ``scan`` finds what the vectors wait for (``None``: the
    stream ended first), within ``--max-answer-size`` (then a 502 saying the stream had
    ``missing`` in that many bytes). Raises ``ProxyError``: nothing has been sent yet."""
    limit = state.settings.max_answer_bytes
    buffer = bytearray()
    try:
        async for chunk in chunks:
            buffer += chunk
            found = scan(buffer)
            if found is not None:
                return buffer, found
            if len(buffer) > limit:
                raise stream_held_too_long(missing, limit)
    except httpx.HTTPError as exc:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, exc) from exc
    return buffer, None


async def send_head(send: Send, response: httpx.Response) -> None:
    """The head of a rewritten stream: 200 and vLLM's headers (minus hop-by-hop), without its
    ``content-length``: the body changes length where the vectors are joined in."""
    headers = downstream_response_headers(response.headers.raw, drop=STREAM_DROP)
    await send({"type": "http.response.start", "status": 200, "headers": headers})


def encoded_chunk(chunk: dict[str, Any]) -> bytes:
    """A chunk the proxy changed, written back as an event's data.

    Raises ``ProxyError`` (502) if ``chunk`` cannot be written back: orjson reads 1024 levels
    of nesting but writes 254 (vLLM's chunks are a few levels deep).
    """
    try:
        return dump_json(chunk)
    except orjson.JSONEncodeError as exc:
        raise chunk_not_reencodable(exc) from None
