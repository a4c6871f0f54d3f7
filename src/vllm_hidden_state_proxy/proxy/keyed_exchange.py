"""One keyed request to vLLM (:mod:`.keyed_request`): sent, and vLLM's reply and the record
brought together for the client.

- vLLM's replies other than 200 pass through unchanged, with no lookup.
- A JSON 200 gets its vectors joined in (:mod:`.vectors.fields`, sent by :mod:`.replies`).
- A streamed 200 (``text/event-stream``) gets them on its first chunk that carries a choice
  (:mod:`.streams.prompt_vectors`; the Responses API's: :mod:`.streams.responses`).
- The answer's vectors (pooling ``"last_answer"``, ``"all_answer"``) are found once each
  choice's answer has ended (:mod:`.vectors.answers`): in a JSON reply, once it is whole; in a
  stream, on each choice's last chunk (:mod:`.streams.answer_vectors`).

A flagged request never gets a 200 without its vectors: if they cannot be had, the client gets
an error (:mod:`.vectors.lookup`) instead, before any byte of vLLM's reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.types import Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError, not_a_json_object, record_mismatch
from vllm_hidden_state_proxy.proxy.keyed_request import (
    JoinableReply,
    KeyedRequest,
    Reply,
    ReplyBudget,
    UnchangedReply,
)
from vllm_hidden_state_proxy.proxy.replies import send_joined
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.answer_vectors import relay_with_answer_vectors
from vllm_hidden_state_proxy.proxy.streams.events import json_object
from vllm_hidden_state_proxy.proxy.streams.prompt_vectors import relay_with_vectors
from vllm_hidden_state_proxy.proxy.streams.relay import relay_response
from vllm_hidden_state_proxy.proxy.types import FieldsLater
from vllm_hidden_state_proxy.proxy.upstream import open_upstream, transport_error
from vllm_hidden_state_proxy.proxy.vectors.answers import (
    AnswerAsks,
    ChoiceCount,
    choice_counts,
    choice_record,
    choice_records,
    without_asked_token_ids,
)
from vllm_hidden_state_proxy.proxy.vectors.fields import single_prompt_fields
from vllm_hidden_state_proxy.proxy.vectors.lookup import EarlyCapture, wait_for_record
from vllm_hidden_state_proxy.ring import Record
from vllm_hidden_state_proxy.transport import body_chunks, close_quietly
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

#: No Accept-Encoding upstream: the proxy reads (and for streams rewrites) the body.
_NO_ENCODING = frozenset({b"accept-encoding"})


async def record_of(
    state: ProxyState, request: KeyedRequest, early: EarlyCapture | None = None
) -> Record:
    """The request's record; ``ProxyError`` if there is none (see :mod:`.vectors.lookup`), or
    if it lacks a layer or the pooling the request asked for (a hook of another release)."""
    record = await wait_for_record(
        state.rings,
        request.key,
        request.marks,
        state.settings.vector_timeout,
        state.metrics,
        None if early is None else early.found,
        early_counted=early is not None and early.counted,
    )
    wanted = request.wanted
    layers, pooling = wanted.distinct_layers, wanted.request.record_pooling
    if record.pooling != pooling or not set(layers) <= set(record.layers):
        raise record_mismatch(record.layers, record.pooling, layers, pooling)
    return record


async def _read_body(response: httpx.Response, budget: ReplyBudget) -> bytes:
    """The whole body as sent (raises ``httpx.HTTPError`` if the exchange breaks off, and
    ``ProxyError`` past the budget). Raw: vLLM was asked for no content encoding, and the
    decoding layers cost CPU per chunk."""
    chunks = []
    async for chunk in body_chunks(response):
        budget.take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_reply(
    state: ProxyState, request: KeyedRequest, response: httpx.Response, budget: ReplyBudget
) -> Reply:
    """Read a whole reply; for a 200, the parsed body and the record (or ``ProxyError``)."""
    if response.status_code == 200:
        return await _read_completion(state, request, response, budget)
    content = await _received(state, _read_body(response, budget))
    return UnchangedReply(response.status_code, list(response.headers.raw), content)


async def _received(state: ProxyState, reading: Awaitable[bytes]) -> bytes:
    """The body ``reading`` reads; a broken exchange is the proxy's transport error."""
    try:
        return await reading
    except httpx.HTTPError as failure:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure


def _completion_of(content: bytes) -> dict[str, Any]:
    completion = json_object(content)
    if completion is None:
        raise not_a_json_object()
    return completion


async def _read_completion(
    state: ProxyState, request: KeyedRequest, response: httpx.Response, budget: ReplyBudget
) -> JoinableReply:
    """Read a 200 JSON reply, picking the record up meanwhile if the reply takes long (the
    prompt's; the answer's are published when it ends)."""
    if request.asks is not None:
        return await _read_answer_completion(state, request, response, budget, request.asks)
    early = EarlyCapture(state.rings, request.key, request.marks)
    completion = _completion_of(await _received(state, early.during(_read_body(response, budget))))
    record = await record_of(state, request, early)
    return JoinableReply(list(response.headers.raw), completion, (record,))


async def _read_answer_completion(
    state: ProxyState,
    request: KeyedRequest,
    response: httpx.Response,
    budget: ReplyBudget,
    asks: AnswerAsks,
) -> JoinableReply:
    completion = _completion_of(await _received(state, _read_body(response, budget)))
    counts = choice_counts(completion)
    # Published as the answer ended: the rings' counters from here tell an overwrite.
    marks = state.rings.publish_marks()
    records = await choice_records(state, request.key, request.wanted, counts, marks)
    completion = without_asked_token_ids(completion, asks)
    return JoinableReply(list(response.headers.raw), completion, records)


async def fetch_keyed_json(
    state: ProxyState,
    scope: Scope,
    document: dict[str, Any],
    wanted: WantedVectors,
    budget: ReplyBudget,
) -> Reply:
    """Send one keyed, non-streaming request and read the whole reply (the fan-out's
    building block; its requests share ``budget``). Raises ``ProxyError`` when there is no
    usable reply."""
    request = KeyedRequest.prepare(state, document, wanted)
    response = await open_upstream(state, scope, request.body, _NO_ENCODING)
    try:
        return await _read_reply(state, request, response, budget)
    finally:
        await close_quietly(response)


def is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


#: Relays a flagged stream with the vectors (``fields()``) joined in where they ride.
StreamRelay = Callable[[ProxyState, Send, httpx.Response, FieldsLater], Awaitable[None]]


async def keyed_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    wanted: WantedVectors,
    relay_stream: StreamRelay = relay_with_vectors,
) -> None:
    """Serve a flagged request with one keyed request: send it, then respond to the client
    (JSON, or a stream relayed by ``relay_stream``: chat and completions chunks by default)."""
    request = KeyedRequest.prepare(state, document, wanted)
    try:
        response = await open_upstream(state, scope, request.body, _NO_ENCODING)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        await _respond(state, send, request, response, relay_stream)
    except ProxyError as error:
        await send_error(send, error)
    finally:
        await close_quietly(response)


def _respond(
    state: ProxyState,
    send: Send,
    request: KeyedRequest,
    response: httpx.Response,
    relay_stream: StreamRelay,
) -> Awaitable[None]:
    if response.status_code != 200:
        return relay_response(state, send, response)  # vLLM's own error, unchanged
    if is_event_stream(response) and request.asks is not None:
        asks = request.asks

        async def choice_fields(count: ChoiceCount) -> dict[str, Any]:
            marks = state.rings.publish_marks()
            record = await choice_record(state, request.key, request.wanted, count, marks)
            return single_prompt_fields(record, request.wanted)

        return relay_with_answer_vectors(state, send, response, asks, choice_fields)
    if is_event_stream(response):

        async def fields() -> dict[str, Any]:
            return single_prompt_fields(await record_of(state, request), request.wanted)

        return relay_stream(state, send, response, fields)
    return _send_json(state, send, request, response)


async def _send_json(
    state: ProxyState, send: Send, request: KeyedRequest, response: httpx.Response
) -> None:
    budget = ReplyBudget(state.settings.max_answer_bytes)
    reply = await _read_completion(state, request, response, budget)
    await send_joined(send, reply.headers, reply.completion, reply.fields(request.wanted))
