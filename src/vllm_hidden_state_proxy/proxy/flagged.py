"""One flagged request to vLLM: inject a fresh key, forward, and join the vector in.

- vLLM answers other than 200 pass through unchanged, with no vector lookup.
- A JSON 200 gets ``kv_transfer_params.last_hidden_state`` (and the info, on request).
- A streamed 200 (``text/event-stream``) gets the vector on its first chunk that carries a
  choice; headers and that chunk are sent once the vector is in hand (it was published at
  prefill, before vLLM produced the chunk), every other byte is relayed as it arrives.

A flagged request never gets a 200 without its vector: if the vector cannot be had, the client
gets a 504 (or 503) instead, before any byte of vLLM's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from vllm_hidden_state_proxy.protocol import key_to_wire, new_key
from vllm_hidden_state_proxy.proxy.asgi import RawHeaders, Scope, Send, send_response
from vllm_hidden_state_proxy.proxy.errors import ProxyError, send_error
from vllm_hidden_state_proxy.proxy.flag import (
    VectorOptions,
    flagged_request_body,
    parse_completion,
    with_kv_fields,
)
from vllm_hidden_state_proxy.proxy.forward import (
    close_quietly,
    open_upstream,
    relay_body,
    relay_response,
)
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.sse import ChoiceEvent, FirstChoiceScanner, replace_event
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.upstream import build_request, transport_error
from vllm_hidden_state_proxy.proxy.vector_fields import single_prompt_fields
from vllm_hidden_state_proxy.proxy.vectors import VectorRecord, capturing_early, wait_for_vector

#: Upstream headers not copied onto a rebuilt JSON response (the proxy sets its own).
_REBUILT_DROP = frozenset({b"content-length", b"content-type", b"content-encoding"})
#: The streamed body changes length where the vector is joined in.
_STREAM_DROP = frozenset({b"content-length"})
_NO_ENCODING = frozenset({b"accept-encoding"})
#: Most bytes of a stream buffered while looking for its first choice (vLLM's is ~300).
MAX_STREAM_PREFIX = 1024 * 1024


def no_ring_error(ring_dir: str) -> ProxyError:
    return ProxyError(
        503,
        "The hidden-state worker hook is not active in the vLLM environment: install "
        "vllm-hidden-state-proxy into vLLM's Python environment (it registers a "
        "`vllm.general_plugins` entry point), make sure VLLM_PLUGINS (if set) includes "
        f"`hidden_state_hook`, and that vLLM and the proxy use the same ring directory "
        f"({ring_dir}) on shared memory.",
    )


def vector_timeout_error(timeout: float) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state did not arrive within {timeout:g} s of vLLM's answer: it was not "
        "published by the vLLM worker hook.",
    )


def vector_overwritten_error(slots: int | None) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state was overwritten in the shared-memory ring ({slots} slots) before the "
        "proxy read it: more flagged prompts were prefilled meanwhile than the ring holds. "
        "Retry, or raise HIDDEN_STATE_PROXY_RING_SLOTS in vLLM's environment.",
    )


@dataclass
class KeyedRequest:
    """A flagged request body with its fresh key, and the ring's counter when it was sent."""

    key: bytes
    body: bytes
    published_before: int

    @classmethod
    def prepare(cls, state: ProxyState, document: dict[str, Any]) -> KeyedRequest:
        key = new_key()
        body = flagged_request_body(document, key_to_wire(key))
        return cls(key, body, state.ring.publish_count())


async def obtain_vector(
    state: ProxyState, request: KeyedRequest, early: VectorRecord | None = None
) -> VectorRecord:
    """The request's record (``early`` if already captured); ``ProxyError`` 504 if missing."""
    if early is not None:
        return early
    timeout = state.settings.vector_timeout
    wait = await wait_for_vector(state.ring, request.key, timeout, request.published_before)
    if wait.record is None:
        if wait.overwritten:
            state.metrics.vector_misses["overwritten"] += 1
            raise vector_overwritten_error(state.ring.min_slot_count())
        state.metrics.vector_misses["not_published"] += 1
        raise vector_timeout_error(timeout)
    state.metrics.vector_wait.observe(wait.waited)
    return wait.record


@dataclass
class JsonAnswer:
    """vLLM's complete answer to one flagged request, and the vector if it was a 200."""

    status: int
    headers: RawHeaders
    content: bytes
    completion: dict[str, Any] | None = None
    record: VectorRecord | None = None


async def _open(state: ProxyState, scope: Scope, request: KeyedRequest) -> httpx.Response:
    # No Accept-Encoding upstream: the proxy reads (and for streams rewrites) the body.
    upstream = build_request(state.settings, scope, request.body, drop=_NO_ENCODING)
    return await open_upstream(state, upstream)


async def _read_json_answer(
    state: ProxyState, request: KeyedRequest, response: httpx.Response
) -> JsonAnswer:
    """Read a whole answer; for a 200, the parsed body and the vector (or ``ProxyError``)."""
    headers = list(response.headers.raw)
    failure: httpx.HTTPError | None = None

    async def read() -> None:
        nonlocal failure
        try:
            await response.aread()
        except httpx.HTTPError as exc:  # broken connection, undecodable content-encoding
            failure = exc

    if response.status_code != 200:
        await read()
        early = None
    else:
        early = await capturing_early(state.ring, request.key, request.published_before, read)
    if failure is not None:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure
    if response.status_code != 200:
        return JsonAnswer(response.status_code, headers, response.content)
    completion = parse_completion(response.content)
    if completion is None:
        raise ProxyError(502, "vLLM answered 200 with a body that is not a JSON object.")
    record = await obtain_vector(state, request, early)
    return JsonAnswer(200, headers, response.content, completion, record)


async def fetch_flagged_json(
    state: ProxyState, scope: Scope, document: dict[str, Any]
) -> JsonAnswer:
    """Send one flagged, non-streaming request and read the whole answer (fan-out building
    block). Raises ``ProxyError`` when there is no usable answer."""
    request = KeyedRequest.prepare(state, document)
    response = await _open(state, scope, request)
    try:
        return await _read_json_answer(state, request, response)
    finally:
        await close_quietly(response)


async def send_whole(
    send: Send, status: int, upstream_headers: RawHeaders, body: bytes, content_type: bytes
) -> None:
    """A complete response with vLLM's headers (minus hop-by-hop and the ones rebuilt here)."""
    headers = downstream_response_headers(upstream_headers, drop=_REBUILT_DROP)
    await send_response(send, status, body, content_type, headers)


async def send_joined(
    send: Send, headers: RawHeaders, completion: dict[str, Any], fields: dict[str, Any]
) -> None:
    """vLLM's 200 JSON answer with ``fields`` joined into its ``kv_transfer_params``."""
    try:
        body = orjson.dumps(with_kv_fields(completion, fields))
    except orjson.JSONEncodeError as exc:  # e.g. nested deeper than orjson writes
        raise ProxyError(502, f"vLLM's answer cannot be re-encoded with the vector: {exc}") from exc
    await send_whole(send, 200, headers, body, b"application/json")


async def send_answer_unchanged(send: Send, answer: JsonAnswer) -> None:
    """A complete answer as vLLM wrote it (status, content type, body)."""
    content_type = b"application/json"
    for name, value in answer.headers:
        if name.lower() == b"content-type":
            content_type = value
            break
    await send_whole(send, answer.status, answer.headers, answer.content, content_type)


def _is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


async def flagged_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    options: VectorOptions,
    fields: Callable[[VectorRecord, VectorOptions], dict[str, Any]] = single_prompt_fields,
) -> None:
    """Forward one flagged request and answer the client (JSON or stream)."""
    request = KeyedRequest.prepare(state, document)
    try:
        response = await _open(state, scope, request)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        if response.status_code != 200:
            await relay_response(state, send, response)  # vLLM's own error, unchanged
        elif _is_event_stream(response):
            await _relay_stream(state, send, request, response, lambda r: fields(r, options))
        else:
            answer = await _read_json_answer(state, request, response)
            assert answer.completion is not None and answer.record is not None
            joined = fields(answer.record, options)
            await send_joined(send, answer.headers, answer.completion, joined)
    except ProxyError as error:
        await send_error(send, error)
    finally:
        await close_quietly(response)


async def _relay_stream(
    state: ProxyState,
    send: Send,
    request: KeyedRequest,
    response: httpx.Response,
    fields: Callable[[VectorRecord], dict[str, Any]],
) -> None:
    """Hold the stream until its first choice chunk, join the vector there, relay the rest.

    Raises ``ProxyError`` only before the response has started.
    """
    chunks = response.aiter_raw()
    buffer = bytearray()
    scanner = FirstChoiceScanner()
    found: ChoiceEvent | None = None
    try:
        async for chunk in chunks:
            buffer += chunk
            scanned = scanner.scan(buffer)
            if scanned is not None:
                found = scanned if isinstance(scanned, ChoiceEvent) else None
                break
            if len(buffer) > MAX_STREAM_PREFIX:
                raise ProxyError(
                    502, f"vLLM's stream had no choice in its first {MAX_STREAM_PREFIX} bytes."
                )
    except httpx.HTTPError as exc:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, exc) from exc
    head = bytes(buffer)
    if found is not None:
        record = await obtain_vector(state, request)
        head = replace_event(buffer, found, with_kv_fields(found.chunk, fields(record)))
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": downstream_response_headers(response.headers.raw, drop=_STREAM_DROP),
        }
    )
    await send({"type": "http.response.body", "body": head, "more_body": True})
    await relay_body(state, send, chunks)
