"""One keyed request to vLLM: a fresh request key in, vLLM's answer and the record out.

- vLLM answers other than 200 pass through unchanged, with no lookup.
- A JSON 200 gets its vectors joined in (:mod:`.answer_join`).
- A streamed 200 (``text/event-stream``) gets them on its first chunk that carries a choice
  (:mod:`.stream_rewrite`).
- The answer's vectors (pooling ``"last_answer"``) are found once vLLM's answer has ended, one
  per choice (:mod:`.answer_choices`); in a stream, on each choice's last chunk
  (:mod:`.answer_stream`).

A flagged request never gets a 200 without its vectors: if they cannot be had, the client gets
an error (:mod:`.vector_lookup`) instead, before any byte of vLLM's answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    EVERY_PROMPT_POSITION,
    new_request_key,
    request_key_to_wire,
)
from vllm_hidden_state_proxy.proxy.answer_body import send_joined
from vllm_hidden_state_proxy.proxy.answer_choices import (
    AnswerAsks,
    ChoiceCount,
    answer_asks,
    choice_counts,
    choice_record,
    choice_records,
    without_asked_token_ids,
)
from vllm_hidden_state_proxy.proxy.answer_join import (
    prompt_list_fields,
    single_prompt_fields,
)
from vllm_hidden_state_proxy.proxy.answer_stream import relay_with_answer_vectors
from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError, answer_too_large, record_mismatch
from vllm_hidden_state_proxy.proxy.inspection import encode_document
from vllm_hidden_state_proxy.proxy.relay import relay_response
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.stream_rewrite import relay_with_vectors
from vllm_hidden_state_proxy.proxy.types import XARGS, RawHeaders, Scope, Send, WantedVectors
from vllm_hidden_state_proxy.proxy.upstream import (
    close_quietly,
    open_upstream,
    transport_error,
)
from vllm_hidden_state_proxy.proxy.vector_lookup import EarlyCapture, wait_for_record
from vllm_hidden_state_proxy.ring import PublishMarks, Record
from vllm_hidden_state_proxy.wanted_vectors import xargs_entries

#: No Accept-Encoding upstream: the proxy reads (and for streams rewrites) the body.
_NO_ENCODING = frozenset({b"accept-encoding"})


def keyed_body(
    document: dict[str, Any],
    wire_key: str,
    wanted: WantedVectors,
    entries: dict[str, Any] | None = None,
) -> bytes:
    """A keyed request's body: ``document`` with its request key and what to capture in
    ``vllm_xargs`` (plus ``entries``); a mean-pooled or ``"all_prompt"`` request also gets a
    fresh ``cache_salt``, since the hook must see every prompt position and the prefix cache
    would skip the cached ones."""
    xargs = document.get(XARGS)
    merged = dict(xargs) if isinstance(xargs, dict) else {}
    merged.update(entries or {})
    merged.update(xargs_entries(wire_key, wanted))
    sent = {**document, XARGS: merged}
    if wanted.request.record_pooling in EVERY_PROMPT_POSITION:
        sent["cache_salt"] = secrets.token_hex(16)
    return encode_document(sent)


@dataclass(frozen=True)
class KeyedRequest:
    """A request for vLLM with a fresh request key in its body, and the rings' counters at
    sending."""

    key: bytes
    body: bytes
    wanted: WantedVectors
    marks: PublishMarks
    #: For the answer's vectors: what was added to learn each choice's token count.
    asks: AnswerAsks | None = None

    @classmethod
    def prepare(
        cls, state: ProxyState, document: dict[str, Any], wanted: WantedVectors
    ) -> KeyedRequest:
        key = new_request_key()
        asks = None
        entries: dict[str, Any] = {}
        if wanted.request.pooling in ANSWER_POOLINGS:
            fields, entries, asks = answer_asks(document)
            document = {**document, **fields}
        body = keyed_body(document, request_key_to_wire(key), wanted, entries)
        return cls(key, body, wanted, state.rings.publish_marks(), asks)


@dataclass(frozen=True)
class VllmAnswer:
    """vLLM answered other than 200: relayed as it is, no record looked up."""

    status: int
    headers: RawHeaders
    content: bytes


@dataclass(frozen=True)
class JoinableAnswer:
    """vLLM's 200 JSON completion, and the request's records: one of the prompt, or one per
    choice (the answer's vectors), in choice order."""

    headers: RawHeaders
    completion: dict[str, Any]
    records: tuple[Record, ...]

    @property
    def record(self) -> Record:
        """The prompt's record (the only one)."""
        return self.records[0]

    def fields(self, wanted: WantedVectors) -> dict[str, Any]:
        """The vectors' fields: singular for one record, one entry per choice otherwise."""
        if len(self.records) == 1:
            return single_prompt_fields(self.records[0], wanted)
        return prompt_list_fields(self.records, wanted)


Answer = VllmAnswer | JoinableAnswer


async def record_of(
    state: ProxyState, request: KeyedRequest, early: EarlyCapture | None = None
) -> Record:
    """The request's record; ``ProxyError`` if there is none (see :mod:`.vector_lookup`), or
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
    content = await _received(state, _read_body(response, budget))
    return VllmAnswer(response.status_code, list(response.headers.raw), content)


async def _received(state: ProxyState, reading: Awaitable[bytes]) -> bytes:
    """The body ``reading`` reads; a broken exchange is the proxy's transport error."""
    try:
        return await reading
    except httpx.HTTPError as failure:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure


def _completion_of(content: bytes) -> dict[str, Any]:
    completion = parse_completion(content)
    if completion is None:
        raise ProxyError(502, "vLLM answered 200 with a body that is not a JSON object.")
    return completion


def parse_completion(body: bytes) -> dict[str, Any] | None:
    """vLLM's 200 JSON response as a dict, or ``None`` if it is not a JSON object."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return document if isinstance(document, dict) else None


async def _read_completion(
    state: ProxyState, request: KeyedRequest, response: httpx.Response, budget: AnswerBudget
) -> JoinableAnswer:
    """Read a 200 JSON answer, picking the record up meanwhile if the answer takes long (the
    prompt's; the answer's are published when it ends)."""
    if request.asks is not None:
        return await _read_answer_completion(state, request, response, budget, request.asks)
    early = EarlyCapture(state.rings, request.key, request.marks)
    completion = _completion_of(await _received(state, early.during(_read_body(response, budget))))
    record = await record_of(state, request, early)
    return JoinableAnswer(list(response.headers.raw), completion, (record,))


async def _read_answer_completion(
    state: ProxyState,
    request: KeyedRequest,
    response: httpx.Response,
    budget: AnswerBudget,
    asks: AnswerAsks,
) -> JoinableAnswer:
    completion = _completion_of(await _received(state, _read_body(response, budget)))
    counts = choice_counts(completion)
    # Published as the answer ended: the rings' counters from here tell an overwrite.
    marks = state.rings.publish_marks()
    records = await choice_records(state, request.key, request.wanted, counts, marks)
    completion = without_asked_token_ids(completion, asks)
    return JoinableAnswer(list(response.headers.raw), completion, records)


async def fetch_keyed_json(
    state: ProxyState,
    scope: Scope,
    document: dict[str, Any],
    wanted: WantedVectors,
    budget: AnswerBudget,
) -> Answer:
    """Send one keyed, non-streaming request and read the whole answer (the fan-out's
    building block; its requests share ``budget``). Raises ``ProxyError`` when there is no
    usable answer."""
    request = KeyedRequest.prepare(state, document, wanted)
    response = await open_upstream(state, scope, request.body, _NO_ENCODING)
    try:
        return await _read_answer(state, request, response, budget)
    finally:
        await close_quietly(response)


def is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


#: Relays a flagged stream with the vectors (``fields()``) joined in where they ride.
StreamRelay = Callable[
    [ProxyState, Send, httpx.Response, Callable[[], Awaitable[dict[str, Any]]]], Awaitable[None]
]


async def keyed_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    wanted: WantedVectors,
    relay_stream: StreamRelay = relay_with_vectors,
) -> None:
    """Answer a flagged request with one keyed request: send it, answer the client (JSON, or a
    stream relayed by ``relay_stream``: chat and completions chunks by default)."""
    request = KeyedRequest.prepare(state, document, wanted)
    try:
        response = await open_upstream(state, scope, request.body, _NO_ENCODING)
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
    budget = AnswerBudget(state.settings.max_answer_bytes)
    answer = await _read_completion(state, request, response, budget)
    await send_joined(send, answer.headers, answer.completion, answer.fields(request.wanted))
