"""Which requests are selected, and which row of a step's hidden states holds their vector.

Pure logic with no vLLM or torch imports, so it is unit-tested on synthetic batches.

A step computes ``ns`` tokens of a request whose ``nc`` tokens were already computed (prefix
cache hits, earlier chunks of a chunked prefill, or zero after preemption). Its tokens occupy
rows ``query_start .. query_start + ns - 1`` of the step's hidden states. The prompt's last
position ``P - 1`` is in this step iff ``nc <= P - 1 < nc + ns``, and then its row is
``query_start + (P - 1 - nc)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, request_key_from_wire


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One selected request's place in a step, read from the model runner's own state."""

    req_id: str
    query_start: int  # first row of this request's tokens in the step's hidden states
    num_computed: int  # tokens computed before this step (nc)
    num_scheduled: int  # tokens computed in this step (ns)
    num_prompt_tokens: int  # prompt length (P), image/placeholder tokens included


def last_prompt_row(request: ScheduledRequest) -> int | None:
    """Row of the prompt's last position in this step, or None if the step does not compute it."""
    last = request.num_prompt_tokens - 1
    if last < 0 or request.num_scheduled <= 0:
        return None
    if request.num_computed <= last < request.num_computed + request.num_scheduled:
        return request.query_start + (last - request.num_computed)
    return None


def key_of(sampling_params: Any) -> bytes | None:
    """The proxy's key from a request's ``SamplingParams.extra_args``, if it carries one."""
    extra_args = getattr(sampling_params, "extra_args", None)
    if not extra_args:
        return None
    value = extra_args.get(REQUEST_KEY_ENTRY) if isinstance(extra_args, Mapping) else None
    return None if value is None else request_key_from_wire(value)


class SelectedRequests:
    """Requests waiting for their last prompt token, keyed by vLLM request id (worker-local).

    A key is published once: child requests of ``n > 1`` share the parent's key, and a request
    re-prefilled after preemption computes its last prompt token again. Recently published keys
    are remembered (bounded) so neither publishes a duplicate.
    """

    def __init__(self, remember_published: int = 65536) -> None:
        self.pending: dict[str, bytes] = {}
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember_published

    def observe(self, new_requests: Iterable[Any], finished_req_ids: Iterable[str]) -> None:
        """Track newly scheduled requests that carry a key; forget finished ones."""
        # Forget finished requests first: an id may finish and be reused in the same step.
        if self.pending:
            for req_id in finished_req_ids:
                self.pending.pop(req_id, None)
        for new_request in new_requests:
            key = key_of(getattr(new_request, "sampling_params", None))
            if key is not None and key not in self._published:
                self.pending[new_request.req_id] = key

    def mark_published(self, req_id: str, key: bytes) -> None:
        self.pending.pop(req_id, None)
        self._published[key] = None
        if len(self._published) > self._remember:
            self._published.popitem(last=False)
        # Siblings (n > 1 children) waiting on the same key need not publish it again.
        for other_id in [rid for rid, k in self.pending.items() if k == key]:
            del self.pending[other_id]

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.pending.pop(req_id, None)
