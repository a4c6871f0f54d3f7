"""A flagged list of completions prompts sent to vLLM as one keyed request.

vLLM runs each prompt of a list as an engine request of its own, all with one
``SamplingParams`` (one ``extra_args``, so one request key). What tells them apart is the id
vLLM gives each (``vllm/entrypoints/openai/completion/serving.py``,
``vllm/v1/engine/input_processor.py``, ``vllm/v1/engine/parallel_sampling.py``): prompt ``i``
of a request whose ``request_id`` is ``base`` runs as ``"cmpl-{base}-{i}"`` plus ``"-"`` and 8
random hex characters (none with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), choice ``c`` of
``n > 1`` as ``"{c}_"`` before that. So the proxy sets the ``request_id`` itself (a fresh
``base``, as ``X-Request-Id``, which vLLM prefers, and in the body; the client's is not sent)
and puts the base, the list's length, ``n`` and, for token-id prompts, each prompt's token count
and checksum in ``vllm_xargs`` (:func:`list_entries`). The hook parses each prompt's index from
its id and publishes its records under :func:`~vllm_hidden_state_proxy.protocol.prompt_key` of
the list's key and the index, or an error record (an id that does not parse: under the list's
key, which the proxy watches for every prompt). The proxy looks each prompt's record up by its
key and checks its token count where it knows it: a prompt never gets another's vector.

``"mean"`` needs every prompt position computed: the list is sent with one fresh ``cache_salt``
(one a request), so no other request's cached blocks serve it, but a prompt that shares a
block-long prefix with another prompt of the list may be served those blocks, and the hook then
answers it with an error record of status ``PREFIX_GAP_STATUS``
(:class:`~..worker_hook.selection.MeanGap`) instead of a mean. Each such prompt is sent again
alone (:func:`records_alone`: its own request, key and salt, one token, one choice, nothing
else asked) for its vector; its choices stay the list's. Spans and ``"all_prompt"`` still fan
out (:mod:`.fan_out`; a matrix each, reserved in the arena per request). So does an
answer's pooling with ``echo`` (vLLM leaves the echoed prompt out of the text once the proxy
asks for the token ids it counts the answers by), and a list whose records would take more than
a quarter of the smallest ring's slots (:data:`RING_SHARE`): they are all published before
vLLM's reply ends, and read after it (a fan-out reads each prompt's after its own reply).

``POST /v1/chat/completions/batch`` (vLLM's conversations of one request, ``n`` 1) is served the
same way: conversation ``i`` runs as ``"chatcmpl-{base}_{i}"`` and the suffix
(``vllm/entrypoints/openai/chat_completion/batch_serving.py``), a conversation sent again
alone goes to ``/v1/chat/completions``; the poolings that fan out for a completions list are
refused there (send each conversation to ``/v1/chat/completions``).
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
from starlette.types import Scope, Send

from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    ANSWER_WINDOW,
    CHAT_PATH,
    CHOICES_ENTRY,
    COMPLETIONS_PATH,
    EVERY_PROMPT_POSITION,
    LIST_BASE_ENTRY,
    LIST_CHECKSUMS_ENTRY,
    LIST_FORM_ENTRY,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    new_request_key,
    prompt_key,
    request_key_to_wire,
    token_ids_checksum,
)
from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    alone_failed,
    completions_not_mergeable,
    list_record_mismatch,
    not_a_json_object,
    record_mismatch,
)
from vllm_hidden_state_proxy.proxy.fan_out import Failed, Job, at_path, fetch_all
from vllm_hidden_state_proxy.proxy.keyed_request import ReplyBudget, keyed_body
from vllm_hidden_state_proxy.proxy.replies import send_joined
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import json_object
from vllm_hidden_state_proxy.proxy.streams.relay import relay_response
from vllm_hidden_state_proxy.proxy.types import RawHeaders
from vllm_hidden_state_proxy.proxy.upstream import open_upstream, transport_error
from vllm_hidden_state_proxy.proxy.vectors.answers import (
    AnswerAsks,
    ChoiceCount,
    choice_counts,
    choice_record,
    without_asked_token_ids,
)
from vllm_hidden_state_proxy.proxy.vectors.fields import prompt_list_fields
from vllm_hidden_state_proxy.proxy.vectors.lookup import EarlyRecords, wait_for_record
from vllm_hidden_state_proxy.request_fields import is_int, is_token_ids
from vllm_hidden_state_proxy.ring import PREFIX_GAP_STATUS, Found, PublishMarks, Record
from vllm_hidden_state_proxy.transport import close_quietly
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

_REQUEST_ID_HEADER = b"x-request-id"
_NO_ENCODING = frozenset({b"accept-encoding"})


#: A list sent as one request may take at most this share of the smallest ring's slots: its
#: records are all published before vLLM's reply ends and read only after it, so more would
#: let the list's own later records (and other traffic) overwrite its first ones.
RING_SHARE = 4


def why_not_one_request(
    document: dict[str, Any], wanted: WantedVectors, count: int, slots: int | None
) -> str | None:
    """Why a flagged list of ``count`` prompts cannot be sent as one request (it fans out, or
    a chat batch is refused, saying so); ``None`` if it can be."""
    pooling = wanted.request.pooling
    if wanted.request.record_pooling in EVERY_PROMPT_POSITION and pooling != "mean":
        return (
            f"pooling {pooling!r} needs every prompt position computed, with a cache_salt and "
            "a matrix reserved per request"
        )
    if pooling in ANSWER_POOLINGS and (
        document.get("echo") is True or document.get("include_reasoning") is False
    ):  # the answers are counted by their token ids, which these lose (vLLM's doing)
        return f"pooling {pooling!r} with 'echo' or 'include_reasoning': false"
    per_prompt = {"last_answer": ANSWER_WINDOW, "all_answer": 1}.get(pooling, 0)
    needed = count * per_prompt * choices_of(document) if per_prompt else count
    room = 0 if slots is None else slots // RING_SHARE
    if needed > room:
        return (
            f"its {needed} records would take more than a quarter of the ring's {slots} slots "
            "(HIDDEN_STATE_PROXY_RING_SLOTS) before the proxy can read them"
        )
    return None


def choices_of(document: dict[str, Any]) -> int:
    n = document.get("n")
    return n if is_int(n) and n > 1 else 1


def list_entries(base: str, prompts: list[Any], choices: int, form: str = "cmpl") -> dict[str, Any]:
    """The ``vllm_xargs`` entries that tell the hook the list's prompts apart."""
    entries: dict[str, Any] = {LIST_BASE_ENTRY: base, LIST_SIZE_ENTRY: len(prompts)}
    if form != "cmpl":
        entries[LIST_FORM_ENTRY] = form
    if choices > 1:
        entries[CHOICES_ENTRY] = choices
    if all(is_token_ids(prompt) for prompt in prompts):
        entries[LIST_TOKENS_ENTRY] = [len(prompt) for prompt in prompts]
        entries[LIST_CHECKSUMS_ENTRY] = [token_ids_checksum(prompt) for prompt in prompts]
    return entries


def client_request_id(scope: Scope, document: dict[str, Any]) -> str | None:
    """The request id the client gave (``X-Request-Id``, which vLLM prefers, or the body's
    ``request_id``): what vLLM would have named the completion by."""
    for name, value in scope.get("headers") or ():
        if name.lower() == _REQUEST_ID_HEADER:
            return bytes(value).decode("latin-1")
    body_id = document.get("request_id")
    return body_id if isinstance(body_id, str) else None


def with_request_id(scope: Scope, base: str) -> Scope:
    """``scope`` with the proxy's ``X-Request-Id`` in place of any the client sent."""
    headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() != _REQUEST_ID_HEADER]
    headers.append((_REQUEST_ID_HEADER, base.encode("ascii")))
    return {**scope, "headers": headers}


def as_the_clients(
    headers: RawHeaders, completion: dict[str, Any], client_id: str | None, form: str
) -> tuple[RawHeaders, dict[str, Any]]:
    """vLLM's reply as it would have named it had the client's id been sent."""
    if client_id is None:
        return headers, completion
    try:  # vLLM's X-Request-Id response header (--enable-request-id-headers): the client's
        value = client_id.encode("latin-1")
    except UnicodeEncodeError:  # a body's request_id no header can carry: vLLM's kept
        value = None
    named = [
        (k, value if value is not None and k.lower() == _REQUEST_ID_HEADER else v)
        for k, v in headers
    ]
    return named, {**completion, "id": f"{form}-{client_id}"}


async def prompt_list_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    wanted: WantedVectors,
    prompts: list[Any],
    form: str = "cmpl",
) -> None:
    """Serve a flagged list of prompts (``form`` ``"chatcmpl"``: the conversations of a chat
    batch) with one keyed request: one entry per prompt (one per choice for an answer's
    pooling), in prompt order, or the first error."""
    key, base, choices = new_request_key(), secrets.token_hex(16), choices_of(document)
    entries = list_entries(base, prompts, choices, form)
    asks = None
    if wanted.request.pooling in ANSWER_POOLINGS:  # each choice's count: its token ids
        asks = AnswerAsks(token_ids=document.get("return_token_ids") is not True, choices=choices)
        document = {**document, "return_token_ids": True}
    body = keyed_body({**document, "request_id": base}, request_key_to_wire(key), wanted, entries)
    marks = state.rings.publish_marks()
    # The prompts' records (not the answers': known only by the reply's counts), picked up as
    # they are published, before other traffic can overwrite them.
    keys = [prompt_key(key, index) for index in range(len(prompts))]
    early = EarlyRecords(state.rings, keys if asks is None else [], marks)
    try:
        # vLLM's JSON reply comes whole at the end, headers too: look from the start.
        sending = open_upstream(state, with_request_id(scope, base), body, _NO_ENCODING)
        response = await early.during(sending)
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        if response.status_code != 200:
            await relay_response(state, send, response)  # vLLM's own error, unchanged
            return
        completion = await early.during(_read_completion(state, response))
        choices_listed = completion.get("choices")
        if not isinstance(choices_listed, list) or len(choices_listed) != len(prompts) * choices:
            raise completions_not_mergeable(
                ValueError(f"{len(prompts)} prompts x n = {choices} choices expected")
            )
        if asks is None:
            found = await _prompt_records(state, key, marks, wanted, prompts, early.found)
            gaps = {index: prompts[index] for index, record in enumerate(found) if record is None}
            alone = await records_alone(state, scope, document, wanted, gaps, form) if gaps else {}
            records = [alone[i] if record is None else record for i, record in enumerate(found)]
        else:
            records = await _answer_records(state, key, wanted, completion, choices)
            completion = without_asked_token_ids(completion, asks)
        headers, completion = as_the_clients(
            list(response.headers.raw), completion, client_request_id(scope, document), form
        )
        await send_joined(send, headers, completion, prompt_list_fields(records, wanted))
    except ProxyError as error:
        await send_error(send, error)
    finally:
        await close_quietly(response)


async def _read_completion(state: ProxyState, response: httpx.Response) -> dict[str, Any]:
    budget = ReplyBudget(state.settings.max_answer_bytes)
    chunks = []
    try:
        async for chunk in response.aiter_raw():
            budget.take(len(chunk))
            chunks.append(chunk)
    except httpx.HTTPError as failure:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, failure) from failure
    completion = json_object(b"".join(chunks))
    if completion is None:
        raise not_a_json_object()
    return completion


async def _prompt_records(
    state: ProxyState,
    key: bytes,
    marks: PublishMarks,
    wanted: WantedVectors,
    prompts: list[Any],
    early: dict[bytes, Found],
) -> list[Record | None]:
    """Each prompt's record, in prompt order (``early``: those picked up during the reply):
    under its own key, or an error record under its own or the list's key; ``None`` for a
    prompt whose positions were partly served from the prefix cache (its mean is fetched
    alone)."""
    records: list[Record | None] = []
    for index, prompt in enumerate(prompts):
        own = prompt_key(key, index)
        try:
            record = await wait_for_record(
                state.rings,
                own,
                marks,
                state.settings.vector_timeout,
                state.metrics,
                early.get(own),
                error_key=key,
            )
        except ProxyError as error:
            if error.status != PREFIX_GAP_STATUS:
                raise
            records.append(None)
            continue
        records.append(_checked(record, wanted, index, prompt))
    return records


def _checked(record: Record, wanted: WantedVectors, index: int, prompt: Any) -> Record:
    """``record`` if it is what prompt ``index`` asked for, else a ``ProxyError``."""
    layers, pooling = wanted.distinct_layers, wanted.request.record_pooling
    if record.pooling != pooling or not set(layers) <= set(record.layers):
        raise record_mismatch(record.layers, record.pooling, layers, pooling)
    if is_token_ids(prompt) and record.num_prompt_tokens != len(prompt):
        raise list_record_mismatch(index, record.num_prompt_tokens, len(prompt))
    return record


#: What a request asks for besides its prompt's vector (what is generated and returned, and how
#: it is sent): left out of a prompt sent again alone, which generates one token. The rest (the
#: model, tokenization, a chat's template, tools and documents, the client's ``vllm_xargs``)
#: decides the prompt's tokens and goes as the client sent it.
_ANSWER_FIELDS = frozenset(
    {
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "suffix",
        "stream",
        "stream_options",
        "min_tokens",
        "max_tokens",
        "max_completion_tokens",
        "request_id",
        "return_token_ids",
        "response_format",
        "structured_outputs",
    }
)


def alone_job(scope: Scope, document: dict[str, Any], prompt: Any, form: str) -> Job:
    """Prompt ``prompt`` of a list (a conversation of a chat batch) as a request of its own,
    for its vector: one token, one choice, under a fresh request id."""
    chat = form == "chatcmpl"
    path, field, limit = (
        (CHAT_PATH, "messages", "max_completion_tokens")
        if chat
        else (COMPLETIONS_PATH, "prompt", "max_tokens")
    )
    body = {name: value for name, value in document.items() if name not in _ANSWER_FIELDS}
    body[field], body[limit] = prompt, 1
    return at_path(with_request_id(scope, secrets.token_hex(16)), path), body


async def records_alone(
    state: ProxyState,
    scope: Scope,
    document: dict[str, Any],
    wanted: WantedVectors,
    prompts: dict[int, Any],
    form: str,
) -> dict[int, Record]:
    """The records of a list's ``prompts`` (by index) sent again alone (at most
    ``--fan-out-limit`` at a time), each checked as the list's; ``ProxyError`` for any that
    fails."""
    indices = list(prompts)
    jobs = [alone_job(scope, document, prompts[index], form) for index in indices]
    replies = await fetch_all(state, jobs, wanted)
    if isinstance(replies, Failed):
        failure, index = replies.failure, indices[replies.index]
        if isinstance(failure, ProxyError):
            raise failure
        raise alone_failed(index, failure.status, failure.content)
    return {
        index: _checked(reply.record, wanted, index, prompts[index])
        for index, reply in zip(indices, replies, strict=True)
    }


async def _answer_records(
    state: ProxyState,
    key: bytes,
    wanted: WantedVectors,
    completion: dict[str, Any],
    choices: int,
) -> list[Record]:
    """Each choice's record, in choice order: choice ``j`` of the reply is choice
    ``j % n`` of prompt ``j // n`` (vLLM numbers them so)."""
    marks = state.rings.publish_marks()  # published as each answer ended
    records = []
    for count in choice_counts(completion):
        prompt, choice = divmod(count.index, choices)
        own = ChoiceCount(choice, count.num_output_tokens, count.num_prompt_tokens)
        records.append(await choice_record(state, prompt_key(key, prompt), wanted, own, marks))
    return records
