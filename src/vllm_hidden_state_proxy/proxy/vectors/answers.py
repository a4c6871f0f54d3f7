"""The answer's vectors (pooling ``"last_answer"``): one per choice, found once it has ended.

The worker hook publishes, when a choice finishes, the states of its latest computed positions,
each under :func:`~vllm_hidden_state_proxy.protocol.answer_key` of (request key, choice index,
output token count it chose). The proxy knows which one it needs once it knows how many tokens
the choice generated (``C``): the state that chose token ``C``, at position ``P + C - 2``. So
the proxy reads the counts from vLLM's reply, asking for them where vLLM would not say
(:func:`answer_asks`) and taking them out again if the client did not ask for them itself:

- a JSON answer of one choice: ``usage.completion_tokens`` (nothing asked);
- a JSON answer of ``n > 1`` choices: ``return_token_ids`` (each choice's ``token_ids``), set
  back to ``null`` afterwards (so ``echo``, whose text vLLM leaves out with
  ``return_token_ids``, and ``include_reasoning: false``, which hides the ids, are refused
  with ``n > 1``: :func:`check_answerable`);
- a stream: ``stream_options.include_usage`` and ``continuous_usage_stats`` (each chunk's
  ``usage.completion_tokens`` counts its choice's tokens so far), removed from the chunks
  afterwards (:mod:`..streams.answer_vectors`).

With ``"all_answer"`` a choice has one record, under
:func:`~vllm_hidden_state_proxy.protocol.all_answer_key`: its rows from the last prompt position
on, of which the proxy keeps the first ``C`` (the states that chose tokens ``1 .. C``).

The record is checked against the count (its position, its prompt length against vLLM's
``prompt_token_ids`` where the answer has them): a record that does not fit is a 502, never a
vector of another position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_state_proxy.protocol import CHOICES_ENTRY, KV, POOLING, all_answer_key, answer_key
from vllm_hidden_state_proxy.proxy.errors import (
    answer_not_counted,
    answer_record_misplaced,
    bad_request,
    no_token_generated,
    record_mismatch,
)
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.lookup import wait_for_record
from vllm_hidden_state_proxy.request_fields import is_int
from vllm_hidden_state_proxy.ring import PublishMarks, Record
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

_TOKEN_IDS = "token_ids"
_PROMPT_TOKEN_IDS = "prompt_token_ids"
_STREAM_OPTIONS = "stream_options"


@dataclass(frozen=True)
class AnswerAsks:
    """What the proxy added to a keyed request to learn each choice's token count (and takes
    out of vLLM's reply again)."""

    #: ``return_token_ids: true`` (a JSON answer).
    token_ids: bool = False
    #: ``stream_options.include_usage: true``: the final usage chunk is dropped.
    usage: bool = False
    #: ``stream_options.continuous_usage_stats: true``: each chunk's ``usage`` is removed.
    continuous_usage: bool = False
    #: The request's ``n``.
    choices: int = 1


def _choices(document: dict[str, Any]) -> int:
    n = document.get("n")
    return n if is_int(n) and n > 1 else 1


def check_answerable(document: dict[str, Any]) -> None:
    """400 for a request whose answer would not say each choice's token count, or would say it
    only by losing something the client asked for."""
    if _choices(document) == 1 or document.get("stream") is True:
        return
    for name, value, why in (
        ("echo", True, "vLLM leaves the echoed prompt out of the text with return_token_ids"),
        ("include_reasoning", False, "vLLM then hides the answer's token ids"),
    ):
        if document.get(name) is value:
            raise bad_request(
                f"'{name}': {orjson.dumps(value).decode()} with 'n' > 1 is not supported "
                f"together with {KV}.{POOLING} 'last_answer' ({why}, which the proxy needs "
                "to find each choice's hidden state): send one choice per request, or stream.",
                name,
            )


def answer_asks(document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], AnswerAsks]:
    """(body fields to set, ``vllm_xargs`` entries to add, what was added) for a keyed request
    of ``document`` that wants its answer's vectors."""
    entries: dict[str, Any] = {}
    n = _choices(document)
    if n > 1:
        entries[CHOICES_ENTRY] = n
    if document.get("stream") is True:
        options = document.get(_STREAM_OPTIONS)
        if options is not None and not isinstance(options, dict):
            return {}, entries, AnswerAsks(choices=n)  # vLLM refuses it with its own 400
        merged = dict(options or {})
        usage = merged.get("include_usage") is True
        # vLLM counts per chunk only with both: the client saw none without include_usage.
        asks = AnswerAsks(
            usage=not usage,
            continuous_usage=not (usage and merged.get("continuous_usage_stats") is True),
            choices=n,
        )
        merged["include_usage"] = True
        merged["continuous_usage_stats"] = True
        return {_STREAM_OPTIONS: merged}, entries, asks
    if n == 1:
        return {}, entries, AnswerAsks(choices=n)  # usage.completion_tokens says it
    asks = AnswerAsks(token_ids=document.get("return_token_ids") is not True, choices=n)
    return {"return_token_ids": True}, entries, asks


@dataclass(frozen=True)
class ChoiceCount:
    """One choice of vLLM's reply: its index and how many tokens it generated."""

    index: int
    num_output_tokens: int
    #: The prompt's length where the answer says it (``prompt_token_ids``), for the check.
    num_prompt_tokens: int | None = None


def counted(index: int, num_output_tokens: Any, num_prompt_tokens: Any = None) -> ChoiceCount:
    """A choice's count as vLLM's reply says it; ``ProxyError`` if it says none."""
    if not is_int(num_output_tokens):
        raise answer_not_counted(f"has no token count for choice {index}")
    if num_output_tokens < 1:
        raise no_token_generated(index)
    return ChoiceCount(
        index, num_output_tokens, num_prompt_tokens if is_int(num_prompt_tokens) else None
    )


def choice_counts(completion: dict[str, Any]) -> list[ChoiceCount]:
    """Each choice's token count, from a JSON answer: its ``token_ids`` where they are (asked
    for with ``n > 1``), else (one choice) the answer's ``usage``."""
    choices = completion.get("choices")
    if not isinstance(choices, list) or not choices:
        raise answer_not_counted("has no choices")
    prompt = completion.get(_PROMPT_TOKEN_IDS)  # chat: the answer's; completions: per choice
    usage = completion.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    counts = []
    for choice in choices:
        if not isinstance(choice, dict) or not is_int(choice.get("index")):
            raise answer_not_counted("has a choice without an index")
        index = choice["index"]
        token_ids = choice.get(_TOKEN_IDS)
        if isinstance(token_ids, list):
            own_prompt = choice.get(_PROMPT_TOKEN_IDS, prompt)
            prompt_length = len(own_prompt) if isinstance(own_prompt, list) else None
            counts.append(counted(index, len(token_ids), prompt_length))
        elif len(choices) == 1:
            counts.append(
                counted(index, usage.get("completion_tokens"), usage.get("prompt_tokens"))
            )
        else:
            raise answer_not_counted(f"has no token_ids for choice {index}")
    return counts


def without_asked_token_ids(completion: dict[str, Any], asks: AnswerAsks) -> dict[str, Any]:
    """``completion`` as vLLM writes it without ``return_token_ids`` (``null`` in their place),
    if the proxy asked for them."""
    if not asks.token_ids:
        return completion
    restored = dict(completion)
    if _PROMPT_TOKEN_IDS in restored:
        restored[_PROMPT_TOKEN_IDS] = None
    choices = []
    for choice in restored.get("choices") or []:
        if isinstance(choice, dict):
            choice = dict(choice)
            for name in (_TOKEN_IDS, _PROMPT_TOKEN_IDS):
                if name in choice:
                    choice[name] = None
        choices.append(choice)
    restored["choices"] = choices
    return restored


async def choice_record(
    state: ProxyState,
    key: bytes,
    wanted: WantedVectors,
    count: ChoiceCount,
    marks: PublishMarks,
) -> Record:
    """The record of one finished choice; ``ProxyError`` if there is none or it does not fit
    (an error record under the request key answers for every choice)."""
    pooling = wanted.request.pooling
    matrix = pooling == "all_answer"
    record = await wait_for_record(
        state.rings,
        all_answer_key(key, count.index)
        if matrix
        else answer_key(key, count.index, count.num_output_tokens),
        marks,
        state.settings.vector_timeout,
        state.metrics,
        error_key=key,
    )
    layers = wanted.distinct_layers
    if record.pooling != pooling or not set(layers) <= set(record.layers):
        raise record_mismatch(record.layers, record.pooling, layers, pooling)
    first = record.num_prompt_tokens - 1
    expected = first if matrix else record.num_prompt_tokens + count.num_output_tokens - 2
    prompt_differs = (
        count.num_prompt_tokens is not None and count.num_prompt_tokens != record.num_prompt_tokens
    )
    too_few = matrix and record.rows < count.num_output_tokens
    if record.position != expected or prompt_differs or too_few:
        raise answer_record_misplaced(
            count.index,
            record.position,
            record.rows,
            record.num_prompt_tokens,
            count.num_output_tokens,
            count.num_prompt_tokens if prompt_differs else None,
            expected,
        )
    return record.first_rows(count.num_output_tokens) if matrix else record


async def choice_records(
    state: ProxyState,
    key: bytes,
    wanted: WantedVectors,
    counts: list[ChoiceCount],
    marks: PublishMarks,
) -> tuple[Record, ...]:
    """The records of every choice, in the order of ``counts``. One after the other: every
    choice has finished when vLLM's JSON answer is complete, so the first wait is the only
    one that can be long."""
    return tuple([await choice_record(state, key, wanted, count, marks) for count in counts])
