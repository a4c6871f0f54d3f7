"""What one keyed request is made of: its body (a fresh request key and what to capture in
``vllm_xargs``, :func:`keyed_body`), the request as sent (:class:`KeyedRequest`), vLLM's reply
to it read whole (:data:`Reply`: relayed unchanged, or joinable), and the bytes of replies one
client request may hold (:class:`ReplyBudget`). Sending it is :mod:`.keyed_exchange`'s.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    EVERY_PROMPT_POSITION,
    XARGS,
    new_request_key,
    request_key_to_wire,
)
from vllm_hidden_state_proxy.proxy.errors import reply_too_large
from vllm_hidden_state_proxy.proxy.inspection import encode_document
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.types import RawHeaders
from vllm_hidden_state_proxy.proxy.vectors.answers import (
    AnswerAsks,
    answer_asks,
)
from vllm_hidden_state_proxy.proxy.vectors.fields import prompt_list_fields, single_prompt_fields
from vllm_hidden_state_proxy.ring import PublishMarks, Record
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, xargs_entries


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
class UnchangedReply:
    """vLLM replied other than 200: relayed as it is, no record looked up."""

    status: int
    headers: RawHeaders
    content: bytes


@dataclass(frozen=True)
class JoinableReply:
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


Reply = UnchangedReply | JoinableReply


class ReplyBudget:
    """The bytes of vLLM's replies one client request may still hold in memory: a flagged
    reply is read whole (its vectors are joined in), and ``n``, ``logprobs``, ``echo`` or
    ``prompt_logprobs`` can make it large. The requests a prompt list fans out to share one
    budget, so their merged reply is bounded too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def take(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise reply_too_large(self.limit)
