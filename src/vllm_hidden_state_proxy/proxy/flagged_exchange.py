"""One flagged request to vLLM: a fresh request key in, vLLM's answer and the record out.

- vLLM answers other than 200 pass through unchanged, with no lookup.
- A JSON 200 gets its vectors joined in (:mod:`.answer_join`).
- A streamed 200 (``text/event-stream``) gets them on its first chunk that carries a choice
  (:mod:`.stream_rewrite`).

A flagged request never gets a 200 without its vectors: if they cannot be had, the client gets
an error (:mod:`.vector_lookup`) instead, before any byte of vLLM's answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from vllm_hidden_state_proxy.protocol import new_request_key, request_key_to_wire
from vllm_hidden_state_proxy.proxy.answer_join import send_joined, single_prompt_fields
from vllm_hidden_state_proxy.proxy.asgi import RawHeaders, Scope, Send, send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError, answer_too_large, record_mismatch
from vllm_hidden_state_proxy.proxy.inspection import WantedVectors, flagged_body, parse_completion
from vllm_hidden_state_proxy.proxy.relay import close_quietly, open_upstream, relay_response
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.stream_rewrite import is_event_stream, relay_with_vectors
from vllm_hidden_state_proxy.proxy.upstream import build_request, transport_error
from vllm_hidden_state_proxy.proxy.vector_lookup import EarlyCapture, wait_for_record
from vllm_hidden_state_proxy.ring import Found, PublishMarks, Record

#: No Accept-Encoding upstream: the proxy reads (and for streams rewrites) the body.
_NO_ENCODING = frozenset({b"accept-encoding"})


@dataclass(frozen=True)
class KeyedRequest:
    """A flagged request body with its fresh request key, and the rings' counters at sending."""

    key: bytes
    body: bytes
    wanted: WantedVectors
    marks: PublishMarks

    @classmethod
    def prepare(
        cls, state: ProxyState, document: dict[str, Any], wanted: WantedVectors
    ) -> KeyedRequest:
        key = new_request_key()
        body = flagged_body(document, request_key_to_wire(key), wanted)
        return cls(key, body, wanted, state.rings.publish_marks())


@dataclass(frozen=True)
class VllmAnswer:
    """vLLM answered other than 200: relayed as it is, no record looked up."""

    status: int
    headers: RawHeaders
    content: bytes


@dataclass(frozen=True)
class JoinableAnswer:
    """vLLM's 200 JSON completion, and the request's record."""

    headers: RawHeaders
    completion: dict[str, Any]
    record: Record


Answer = VllmAnswer | JoinableAnswer


async def record_of(state: ProxyState, request: KeyedRequest, early: Found | None = None) -> Record:
    """The request's record; ``ProxyError`` if there is none (see :mod:`.vector_lookup`), or
    if it lacks a layer or the pooling the request asked for (a hook of another release)."""
    record = await wait_for_record(
        state.rings,
        request.key,
        request.marks,
        state.settings.vector_timeout,
        state.metrics,
        early,
    )
    wanted = request.wanted
    layers, pooling = wanted.distinct_layers, wanted.request.pooling
    if record.pooling != pooling or not set(layers) <= set(record.layers):
        raise record_mismatch(record.layers, record.pooling, layers, pooling)
    return record


async def _open(state: ProxyState, scope: Scope, request: KeyedRequest) -> httpx.Response:
    upstream = build_request(state.settings, scope, request.body, drop=_NO_ENCODING)
    return await open_upstream(state, upstream)


class AnswerBudget:
    """The bytes of vLLM's answers one client request may still hold in memory: a flagged
    answer is read whole (its vectors are joined in), and ``n``, ``logprobs``, ``echo`` or
    ``prompt_logprobs`` can make it large. The requests a prompt list fans out to share one
    budget, so their merged answer is bounded too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def take(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise answer_too_large(self.limit)


async def _read_body(response: httpx.Response, budget: AnswerBudget) -> bytes:
    """The whole body as sent (raises ``httpx.HTTPError`` if the exchange breaks off, and
    ``ProxyError`` past the budget). Raw: vLLM was asked for no content encoding, and the
    decoding layers cost CPU per chunk."""
    chunks = []
    async for chunk in response.aiter_raw():
        budget.take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_answer(
    state: ProxyState, request: KeyedRequest, response: httpx.Response, budget: AnswerBudget
) -> Answer:
    """Read a whole answer; for a 200, the parsed body and the record (or ``ProxyError``)."""
    if response.status_code == 200:
        return await _read_completion(state, request, response, budget)
    try:
        content = await _read_body(response, budget)
    except httpx.HTTPError as failure:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure
    return VllmAnswer(response.status_code, list(response.headers.raw), content)


async def _read_completion(
    state: ProxyState, request: KeyedRequest, response: httpx.Response, budget: AnswerBudget
) -> JoinableAnswer:
    """Read a 200 JSON answer, picking the record up meanwhile if the answer takes long."""
    early = EarlyCapture(state.rings, request.key, request.marks)
    try:
        content = await early.during(_read_body(response, budget))
    except httpx.HTTPError as failure:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure
    completion = parse_completion(content)
    if completion is None:
        raise ProxyError(502, "vLLM answered 200 with a body that is not a JSON object.")
    record = await record_of(state, request, early.found)
    return JoinableAnswer(list(response.headers.raw), completion, record)


async def fetch_flagged_json(
    state: ProxyState,
    scope: Scope,
    document: dict[str, Any],
    wanted: WantedVectors,
    budget: AnswerBudget,
) -> Answer:
    """Send one flagged, non-streaming request and read the whole answer (the fan-out's
    building block; its requests share ``budget``). Raises ``ProxyError`` when there is no
    usable answer."""
    request = KeyedRequest.prepare(state, document, wanted)
    response = await _open(state, scope, request)
    try:
        return await _read_answer(state, request, response, budget)
    finally:
        await close_quietly(response)


#: Relays a flagged stream with the vectors (``fields()``) joined in where they ride.
StreamRelay = Callable[
    [ProxyState, Send, httpx.Response, Callable[[], Awaitable[dict[str, Any]]]], Awaitable[None]
]


async def flagged_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    wanted: WantedVectors,
    relay_stream: StreamRelay = relay_with_vectors,
) -> None:
    """Forward one flagged request and answer the client (JSON, or a stream relayed by
    ``relay_stream``: chat and completions chunks by default)."""
    request = KeyedRequest.prepare(state, document, wanted)
    try:
        response = await _open(state, scope, request)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        await _answer(state, send, request, response, relay_stream)
    except ProxyError as error:
        await send_error(send, error)
    finally:
        await close_quietly(response)


def _answer(
    state: ProxyState,
    send: Send,
    request: KeyedRequest,
    response: httpx.Response,
    relay_stream: StreamRelay,
) -> Awaitable[None]:
    if response.status_code != 200:
        return relay_response(state, send, response)  # vLLM's own error, unchanged
    if is_event_stream(response):

        async def fields() -> dict[str, Any]:
            return single_prompt_fields(await record_of(state, request), request.wanted)

        return relay_stream(state, send, response, fields)
    return _send_json(state, send, request, response)


async def _send_json(
    state: ProxyState, send: Send, request: KeyedRequest, response: httpx.Response
) -> None:
    budget = AnswerBudget(state.settings.max_answer_bytes)
    answer = await _read_completion(state, request, response, budget)
    fields = single_prompt_fields(answer.record, request.wanted)
    await send_joined(send, answer.headers, answer.completion, fields)
