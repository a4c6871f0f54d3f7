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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    CHOICES_ENTRY,
    LAYERS_ENTRY,
    MAX_SPANS,
    POOLING_ENTRY,
    POOLINGS,
    REQUEST_KEY_ENTRY,
    SPANS_ENTRY,
    SPANS_POOLING,
    request_key_from_wire,
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
            " were served from the prefix cache (the proxy sends a fresh cache_salt with such "
            "requests; was this one sent around it?)"
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
    ) -> None:
        self.captured = tuple(captured)
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
            params = getattr(new_request, "sampling_params", None)
            selection = selection_of(params, self.captured, self.final_layer)
            if selection is not None and selection.key not in self._published:
                self.pending[new_request.req_id] = selection

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
