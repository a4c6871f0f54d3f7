"""Inputs grouped into requests: a **batch** is up to ``--batch-size`` inputs of one kind sent
in one request, and its body is made of pieces encoded once.

- Text prompts, and token-id prompts, each go as one ``/v1/completions`` list (``prompt``: a
  list of strings, or of token-id lists: the proxy takes one kind a list);
- chats as one ``/v1/chat/completions/batch`` request (``messages``: a list of conversations;
  vLLM's route takes ``n`` = 1 only, so with ``--n`` above 1 a chat goes alone);
- an input with ``spans`` goes alone (its spans are fields of the request, not of a prompt).

A batch of one is sent as extract always sent an input: its own ``/v1/completions`` or
``/v1/chat/completions`` request, the prompt not in a list. Each input's prompt (or chat) is
encoded once, when it is read; the fields every request shares (the model, the flag, the
layers) once a run; a request's body is those bytes joined, so a batch split in halves after a
failure costs no encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_state_proxy.client import hidden_state_fields
from vllm_hidden_state_proxy.extract.exchange import Refused, encode_body
from vllm_hidden_state_proxy.extract.inputs import Input, InputProblem

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CHAT_BATCH = "/v1/chat/completions/batch"
#: The kinds of batch (and ``single``: an input that goes alone).
TEXT, IDS, CHATS, SINGLE = "text", "ids", "chats", "single"
#: The fields a request's body sets per kind, dropped from ``--extra-body`` (they replace it).
_OWN_FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens")
#: Inputs that are not sent (a problem, an id already written) between two turns of the event
#: loop: a million duplicates must not hold off Ctrl-C or the connections' keep-alive.
_INPUTS_PER_TURN = 64


@dataclass(frozen=True)
class Item:
    """An input ready to send: its prompt's (or chat's) JSON, encoded once."""

    input: Input
    payload: bytes
    kind: str
    #: Why it cannot be sent (its prompt is no JSON a request carries): it fails unsent.
    refused: Refused | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """Its count of prompt tokens where extract knows it: a token-id prompt's length."""
        prompt = self.input.prompt
        return len(prompt) if isinstance(prompt, list) and self.input.spans is None else None


def _encode(value: Any) -> bytes:
    """``value`` as JSON: orjson, or where it refuses (an integer of more than 64 bits) the
    standard library's, whose :class:`Refused` says why none is sent. (The corpus' reading
    refuses ``NaN``, which orjson would write as ``null``.)"""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return encode_body({"": value}, max_bytes=1 << 62)[4:-1]


class BodyMaker:
    """The bodies of a run's requests (see the module docstring)."""

    def __init__(self, plan: Mapping[str, Any], extra_body: Mapping[str, Any] | None) -> None:
        self.plan = plan
        self.extra = {k: v for k, v in (extra_body or {}).items() if k not in _OWN_FIELDS}
        self._shared: bytes | Refused | None = None
        self._max_tokens = {
            "prompt": b',"max_tokens":' + orjson.dumps(plan["max_tokens"]),
            "messages": b',"max_completion_tokens":' + orjson.dumps(plan["max_tokens"]),
        }

    def _fields(self, spans: Any) -> bytes:
        """The fields every request of the run shares (or, with spans, this input's), as the
        start of a JSON object without its closing brace."""
        extra = dict(self.extra)
        plan = self.plan
        try:
            fields = hidden_state_fields(
                layers=plan["layers"],
                pooling=plan["pooling"],
                spans=spans,
                dtype=plan["dtype"],
                info=True,
                kv_transfer_params=extra.pop("kv_transfer_params", None),
            )
        except ValueError as exc:  # the client module's checks (spans)
            raise Refused(str(exc), 400) from None
        body = {"model": plan["model"], "n": plan["n"], **extra, **fields}
        return encode_body(body, max_bytes=1 << 62)[:-1]

    def shared(self) -> bytes:
        if self._shared is None:
            try:
                self._shared = self._fields(None)
            except Refused as refused:
                self._shared = refused
        if isinstance(self._shared, Refused):
            raise self._shared
        return self._shared

    def body(self, items: list[Item]) -> tuple[str, bytes]:
        """The path and body of a request for ``items`` (one, or a batch of one kind)."""
        first = items[0]
        start = self._fields(first.input.spans) if first.input.spans is not None else self.shared()
        name = "prompt" if first.input.messages is None else "messages"
        if len(items) == 1:
            value = first.payload
            path = COMPLETIONS if name == "prompt" else CHAT
        else:
            value = b"[" + b",".join(item.payload for item in items) + b"]"
            path = COMPLETIONS if name == "prompt" else CHAT_BATCH
        body = b"".join((start, b',"', name.encode(), b'":', value, self._max_tokens[name], b"}"))
        return path, body


def kind_of(item: Input, n: int) -> str:
    if item.spans is not None:
        return SINGLE
    if item.messages is not None:
        return CHATS if n == 1 else SINGLE
    return TEXT if isinstance(item.prompt, str) else IDS


class Batcher:
    """Batches from one iterator of inputs, shared by every sender: each input once, inputs of
    one kind together (a kind's batch fills as its inputs come; what is left goes at the end).
    Problems and inputs already written go to ``skip`` instead."""

    def __init__(
        self,
        inputs: Iterator[Input | InputProblem],
        size: int,
        n: int,
        skip: Callable[[Input | InputProblem], bool],
    ) -> None:
        self._inputs = inputs
        self.size = size
        self._n = n
        self._skip = skip
        self._waiting: dict[str, list[Item]] = {}
        self._ended = False

    async def next(self) -> list[Item] | None:
        """The next batch, or ``None`` when every input was taken."""
        unsent = 0
        for item in self._inputs:
            if self._skip(item) or not isinstance(item, Input):
                unsent += 1
                if unsent % _INPUTS_PER_TURN == 0:
                    await asyncio.sleep(0)  # the loop's turn: signals, keep-alive
                continue
            kind = kind_of(item, self._n)
            try:
                ready = Item(
                    item, _encode(item.prompt if item.messages is None else item.messages), kind
                )
            except Refused as refused:
                return [Item(item, b"", SINGLE, refused)]
            if kind == SINGLE or self.size == 1:
                return [ready]
            waiting = self._waiting.setdefault(kind, [])
            waiting.append(ready)
            if len(waiting) >= self.size:
                del self._waiting[kind]
                return waiting
        for kind in list(self._waiting):
            return self._waiting.pop(kind)
        return None
