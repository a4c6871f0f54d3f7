"""Which requests are selected, what each wants, and which rows of a step hold their vectors.

Pure logic with no vLLM or torch imports, so it is unit-tested on synthetic batches.

A step computes ``ns`` tokens of a request whose ``nc`` tokens were already computed (prefix
cache hits, earlier chunks of a chunked prefill, or zero after preemption). Its tokens occupy
rows ``query_start .. query_start + ns - 1`` of the step's hidden states.

- **last**: the prompt's last position ``P - 1`` is in this step iff ``nc <= P - 1 < nc + ns``,
  and then its row is ``query_start + (P - 1 - nc)``.
- **mean**: every prompt position ``0 .. P - 1`` must be summed exactly once, across the steps
  that compute them (chunked prefill). :class:`MeanProgress` tracks how far the sum got: a step
  adds the positions from there on (a recomputation after preemption may repeat some, which
  are skipped); a step that starts *past* it (positions served from the prefix cache) leaves a
  gap that makes the mean impossible.

A flagged list of completions prompts sent as one request (all its prompts share one
``extra_args``, so one request key): each prompt's engine request id says its index, as vLLM
forms it from the base the proxy set (:func:`prompt_index`); the prompt's records go under
:func:`~vllm_hidden_state_proxy.protocol.prompt_key` of the list's key and that index, once its
token count and checksum (token-id lists) match what the proxy sent (:func:`list_selection`).
An id that does not parse, or a prompt that does not match, gets an error record: never another
prompt's vector.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    CHOICES_ENTRY,
    LAYERS_ENTRY,
    LIST_BASE_ENTRY,
    LIST_CHECKSUMS_ENTRY,
    LIST_FORM_ENTRY,
    LIST_FORMS,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    MAX_LIST_SIZE,
    MAX_SPANS,
    POOLING_ENTRY,
    POOLINGS,
    REQUEST_KEY_ENTRY,
    SPANS_ENTRY,
    SPANS_POOLING,
    prompt_key,
    request_key_from_wire,
    token_ids_checksum,
)

#: The most choices a request's choices entry may name.
MAX_CHOICES = 1_000_000


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One selected request's place in a step, read from the model runner's own state."""

    req_id: str
    query_start: int  # first row of this request's tokens in the step's hidden states
    num_computed: int  # tokens computed before this step (nc)
    num_scheduled: int  # tokens computed in this step (ns)
    num_prompt_tokens: int  # prompt length (P), image/placeholder tokens included


@dataclass(frozen=True, slots=True)
class Selection:
    """What one flagged request wants: its request key, layers and pooling, or why it cannot
    be served (``problem``: published as an error record)."""

    key: bytes
    layers: tuple[int, ...]
    pooling: str = "last"
    problem: str | None = None
    #: The request's ``n`` (``"last_answer"``: each choice is a child request of its own).
    choices: int = 1
    #: vLLM's ``max_tokens`` of the request (bounds an ``"all_answer"`` matrix), if known.
    max_tokens: int | None = None
    #: Pooling ``"spans"``: ``(start, end)`` prompt positions, each mean-pooled.
    spans: tuple[tuple[int, int], ...] = ()


def last_prompt_row(request: ScheduledRequest) -> int | None:
    """Row of the prompt's last position in this step, or None if the step does not compute it."""
    last = request.num_prompt_tokens - 1
    if last < 0 or request.num_scheduled <= 0:
        return None
    if request.num_computed <= last < request.num_computed + request.num_scheduled:
        return request.query_start + (last - request.num_computed)
    return None


@dataclass(frozen=True, slots=True)
class MeanRows:
    """Rows ``first .. end - 1`` of this step add prompt positions to a request's mean."""

    first: int
    end: int
    #: Prompt positions summed once these rows are added.
    covered: int


class MeanGap(Exception):
    """Prompt positions were skipped (served from the prefix cache): no mean is possible."""


def mean_rows(request: ScheduledRequest, covered: int) -> MeanRows | None:
    """The rows of this step that extend a mean which has summed ``covered`` positions.

    ``None`` if the step adds no prompt position; :class:`MeanGap` if it skips some.
    """
    nc, ns, prompt = request.num_computed, request.num_scheduled, request.num_prompt_tokens
    if nc > covered:
        raise MeanGap(
            f"this pooling needs all {prompt} prompt positions, but positions {covered}..{nc - 1}"
            " were served from the prefix cache (the proxy sends such a request with a fresh "
            "cache_salt, and a prompt of a list that hit another's blocks again alone; was this "
            "one sent around it?)"
        )
    start, end = max(nc, covered), min(nc + ns, prompt)
    if end <= start:
        return None
    return MeanRows(request.query_start + (start - nc), request.query_start + (end - nc), end)


def request_key_of(sampling_params: Any) -> bytes | None:
    """The proxy's request key from a request's ``SamplingParams.extra_args``, if any."""
    extra_args = getattr(sampling_params, "extra_args", None)
    if not extra_args or not isinstance(extra_args, Mapping):
        return None
    value = extra_args.get(REQUEST_KEY_ENTRY)
    return None if value is None else request_key_from_wire(value)


def selection_of(
    sampling_params: Any, captured: Sequence[int], final_layer: int
) -> Selection | None:
    """What a flagged request wants (``None`` if it is not flagged)."""
    key = request_key_of(sampling_params)
    if key is None:
        return None
    extra_args: Mapping[str, Any] = sampling_params.extra_args
    layers = extra_args.get(LAYERS_ENTRY, [final_layer])
    pooling = extra_args.get(POOLING_ENTRY, "last")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers)
        or len(set(layers)) != len(layers)
    ):
        return Selection(key, (final_layer,), problem=f"malformed layer list {layers!r}")
    missing = [layer for layer in layers if layer not in captured]
    if missing:
        return Selection(
            key,
            (final_layer,),
            problem=f"layers {missing} are not captured by this vLLM engine (it captures "
            f"{', '.join(map(str, captured))}; start it with them in HIDDEN_STATE_PROXY_LAYERS)",
        )
    if pooling not in POOLINGS:
        return Selection(key, (final_layer,), problem=f"unknown pooling {pooling!r}")
    choices = extra_args.get(CHOICES_ENTRY, 1)
    if isinstance(choices, bool) or not isinstance(choices, int) or not 1 <= choices <= MAX_CHOICES:
        return Selection(key, (final_layer,), problem=f"malformed choice count {choices!r}")
    max_tokens = getattr(sampling_params, "max_tokens", None)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = None
    spans = _spans(extra_args.get(SPANS_ENTRY)) if pooling == SPANS_POOLING else ()
    if spans is None:
        return Selection(key, (final_layer,), problem="malformed spans")
    return Selection(
        key,
        tuple(sorted(layers)),
        pooling,
        choices=choices,
        max_tokens=max_tokens,
        spans=spans,
    )


def _spans(value: Any) -> tuple[tuple[int, int], ...] | None:
    """The spans entry (flat: ``start, end, start, end, ...``) as ``(start, end)`` pairs
    (``0 <= start < end``); ``None`` if it is not 1 to ``MAX_SPANS`` of them."""
    if not isinstance(value, list) or len(value) % 2 or not 2 <= len(value) <= 2 * MAX_SPANS:
        return None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        return None
    spans = tuple(zip(value[::2], value[1::2], strict=True))
    return spans if all(0 <= start < end for start, end in spans) else None


#: vLLM's variable that keeps engine request ids as given (no random suffix).
KEEP_IDS_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
#: The hex digits of vLLM's random suffix (``random_uuid()``: lowercase hex).
_HEX = frozenset("0123456789abcdef")
_RANDOM_SUFFIX = 8
#: How much of a request id an error message quotes.
_QUOTED = 80

logger = logging.getLogger(__name__)


def ids_randomized(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether vLLM adds its random suffix to engine request ids (read as ``vllm.envs`` reads
    it; a value vLLM would not parse counts as the default)."""
    try:
        return not bool(int(environ.get(KEEP_IDS_ENV, "0")))
    except ValueError:
        return True


@dataclass(frozen=True, slots=True)
class PromptList:
    """The list marker of a flagged prompt list sent as one request (``vllm_xargs``)."""

    base: str
    size: int
    #: The request's ``n``: each prompt runs as ``n`` child requests ``"{c}_..."``.
    choices: int = 1
    #: Each prompt's token count and checksum, when the proxy sent token ids.
    token_counts: tuple[int, ...] | None = None
    checksums: tuple[int, ...] | None = None
    #: How vLLM names the items (``LIST_FORMS``): completions prompts or chat conversations.
    form: str = "cmpl"


def _count(value: Any) -> int | None:
    """``value`` if it is an int (not a bool) of at least 0."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _is_count(value: Any) -> bool:
    return _count(value) is not None


def prompt_list_of(extra_args: Mapping[str, Any], choices: int) -> PromptList | str | None:
    """The list marker in ``extra_args``; ``None`` if there is none, the problem if it is
    malformed."""
    base = extra_args.get(LIST_BASE_ENTRY)
    size_entry = extra_args.get(LIST_SIZE_ENTRY)
    if base is None and size_entry is None:
        return None
    if not isinstance(base, str) or not 1 <= len(base) <= 64 or not set(base) <= _HEX:
        return "malformed prompt list base"
    size = _count(size_entry)
    if size is None or not 1 <= size <= MAX_LIST_SIZE:
        return "malformed prompt list size"
    form = extra_args.get(LIST_FORM_ENTRY, "cmpl")
    if not isinstance(form, str) or form not in LIST_FORMS:
        return "malformed prompt list form"
    counts = extra_args.get(LIST_TOKENS_ENTRY)
    checksums = extra_args.get(LIST_CHECKSUMS_ENTRY)
    if counts is None and checksums is None:
        return PromptList(base, size, choices, form=form)
    for values in (counts, checksums):
        if not isinstance(values, list) or len(values) != size or not all(map(_is_count, values)):
            return "malformed prompt list checks"
    return PromptList(base, size, choices, tuple(counts), tuple(checksums), form)  # type: ignore[arg-type]


def _index_below(text: str, bound: int) -> int | None:
    """``text`` as vLLM writes an index (``f"{i}"``: ASCII digits, no leading zero) below
    ``bound``, else ``None``."""
    if not text or len(text) > 7 or not text.isascii() or not text.isdigit():
        return None
    if text != "0" and text.startswith("0"):
        return None
    index = int(text)
    return index if index < bound else None


def prompt_index(req_id: str, listed: PromptList, randomized: bool = True) -> int | None:
    """The prompt index of engine request ``req_id`` of the list ``listed``: exactly
    ``["{c}_"] + "cmpl-{base}-{index}" + ["-" + 8 hex]`` as vLLM 0.32 and 0.34 form it (the
    choice prefix when ``n > 1``, the suffix unless vLLM keeps ids; a chat batch's
    conversation: ``"chatcmpl-{base}_{index}"``); ``None`` for anything else."""
    if not isinstance(req_id, str):
        return None
    rest = req_id
    if listed.choices > 1:
        head, sep, rest = req_id.partition("_")
        if not sep or _index_below(head, listed.choices) is None:
            return None
    prefix = f"{listed.form}-{listed.base}{LIST_FORMS[listed.form]}"
    if not rest.startswith(prefix):
        return None
    tail = rest[len(prefix) :]
    if randomized:
        tail, sep, suffix = tail.partition("-")
        if not sep or len(suffix) != _RANDOM_SUFFIX or not set(suffix) <= _HEX:
            return None
    return _index_below(tail, listed.size)


def list_selection(
    selection: Selection,
    listed: PromptList,
    req_id: str,
    prompt_token_ids: Sequence[int] | None,
    randomized: bool = True,
) -> Selection:
    """``selection`` (of the list's key) as the selection of the prompt ``req_id`` is: under
    that prompt's key, with a problem if its token ids do not match what the proxy sent. An id
    that does not parse keeps the list's key with a problem: an error record under it, which
    answers for every prompt of the list."""
    index = prompt_index(req_id, listed, randomized)
    if index is None:
        return replace(
            selection,
            problem=f"vLLM request {req_id[:_QUOTED]!r} is not a prompt of the list "
            f"'{listed.form}-{listed.base}' of {listed.size} prompts as vLLM names them, so its "
            "prompt is unknown",
        )
    key = prompt_key(selection.key, index)
    problem = selection.problem
    if problem is None and listed.token_counts is not None and listed.checksums is not None:
        expected = listed.token_counts[index]
        if prompt_token_ids is None:
            problem = f"prompt {index} of the list has no token ids in vLLM to check"
        elif len(prompt_token_ids) != expected:
            problem = (
                f"prompt {index} of the list has {len(prompt_token_ids)} tokens in vLLM, not "
                f"the {expected} sent"
            )
        elif token_ids_checksum(prompt_token_ids) != listed.checksums[index]:
            problem = f"prompt {index} of the list has other token ids in vLLM than were sent"
    return replace(selection, key=key, problem=problem)


class SelectedRequests:
    """Requests waiting for their vectors, keyed by vLLM request id (worker-local).

    A request key is published once: child requests of ``n > 1`` share the parent's key, and a
    request re-prefilled after preemption computes its prompt again. Recently published keys
    are remembered (bounded) so neither publishes a duplicate.
    """

    def __init__(
        self,
        captured: Sequence[int] = (1,),
        final_layer: int = 1,
        remember_published: int = 65536,
        randomized_ids: bool = True,
    ) -> None:
        self.captured = tuple(captured)
        #: Whether vLLM suffixes engine request ids (how a list's prompt ids are parsed).
        self.randomized_ids = randomized_ids
        self.final_layer = final_layer
        self.pending: dict[str, Selection] = {}
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember_published

    def observe(self, new_requests: Iterable[Any], finished_req_ids: Iterable[str]) -> None:
        """Track newly scheduled requests that carry a key; forget finished ones."""
        # Forget finished requests first: an id may finish and be reused in the same step.
        if self.pending:
            for req_id in finished_req_ids:
                self.pending.pop(req_id, None)
        for new_request in new_requests:
            try:
                selection = self._selection(new_request)
            except Exception:  # one malformed request must not cost the others theirs
                logger.exception("vllm-hidden-state-proxy: reading a new request's selection")
                continue
            if selection is not None and selection.key not in self._published:
                self.pending[new_request.req_id] = selection

    def _selection(self, new_request: Any) -> Selection | None:
        params = getattr(new_request, "sampling_params", None)
        selection = selection_of(params, self.captured, self.final_layer)
        if selection is None:
            return None
        listed = prompt_list_of(getattr(params, "extra_args", None) or {}, selection.choices)
        if listed is None:
            return selection
        if isinstance(listed, str):  # the list's key: an error record for every prompt
            return replace(selection, problem=listed)
        prompt = getattr(new_request, "prompt_token_ids", None)
        return list_selection(selection, listed, new_request.req_id, prompt, self.randomized_ids)

    def has_sibling(self, req_id: str, key: bytes) -> bool:
        """Whether another pending request (an ``n > 1`` child) waits on the same key."""
        return any(other != req_id and s.key == key for other, s in self.pending.items())

    def mark_published(self, req_id: str, key: bytes) -> None:
        self.pending.pop(req_id, None)
        self._published[key] = None
        if len(self._published) > self._remember:
            self._published.popitem(last=False)
        # Siblings (n > 1 children) waiting on the same key need not publish it again.
        for other_id in [rid for rid, s in self.pending.items() if s.key == key]:
            del self.pending[other_id]

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.pending.pop(req_id, None)
