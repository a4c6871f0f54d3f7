"""Send several keyed requests for one client request, a bounded number at a time.

Used for a flagged list of completions prompts and for embeddings inputs. The first failure
(a ``ProxyError`` or a vLLM reply other than 200) cancels what is still in flight; the caller
reports the first failure in input order, so a client never gets a partial list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import Scope

from vllm_hidden_state_proxy.proxy.errors import ProxyError, fan_out_incomplete
from vllm_hidden_state_proxy.proxy.keyed_exchange import fetch_keyed_json
from vllm_hidden_state_proxy.proxy.keyed_request import JoinableReply, ReplyBudget, UnchangedReply
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

#: One upstream request: the scope it is sent as (method, path, headers) and its JSON body.
Job = tuple[Scope, dict[str, Any]]


@dataclass(frozen=True)
class Failed:
    """The first job in input order that failed, and how."""

    index: int
    failure: UnchangedReply | ProxyError


async def fetch_all(
    state: ProxyState, jobs: list[Job], wanted: WantedVectors
) -> list[JoinableReply] | Failed:
    """Every job's reply in job order, or the first failure; at most ``fan_out_limit`` in
    flight."""
    results: list[JoinableReply | UnchangedReply | ProxyError | None] = [None] * len(jobs)
    limiter = anyio.CapacityLimiter(state.settings.fan_out_limit)
    budget = ReplyBudget(state.settings.max_answer_bytes)  # the merged reply's bound too

    async with anyio.create_task_group() as group:

        async def one(index: int, scope: Scope, document: dict[str, Any]) -> None:
            async with limiter:
                try:
                    reply = await fetch_keyed_json(state, scope, document, wanted, budget)
                except ProxyError as error:
                    # Without its traceback: its frames hold ``results`` (this closure's), a
                    # cycle that would keep every reply's records (matrices) in memory until
                    # the garbage collector's next full pass, long after the budget let go.
                    results[index] = error.with_traceback(None)
                    group.cancel_scope.cancel()
                    return
                results[index] = reply
                if isinstance(reply, UnchangedReply):
                    group.cancel_scope.cancel()

        for index, (scope, document) in enumerate(jobs):
            group.start_soon(one, index, scope, document)
    # ``results`` stays reachable from the finished tasks' frames (cancelled ones keep theirs
    # in their CancelledError: cycles the garbage collector frees late): empty it, so that
    # replies (their records: matrices) live only as long as the caller holds them.
    taken, results[:] = list(results), []
    replies: list[JoinableReply] = []
    for index, result in enumerate(taken):
        if isinstance(result, (UnchangedReply, ProxyError)):
            return Failed(index, result)
        if isinstance(result, JoinableReply):
            replies.append(result)
    if len(replies) != len(jobs):  # cancelled without a failure: cannot happen
        return Failed(len(replies), fan_out_incomplete())
    return replies


def at_path(scope: Scope, path: str) -> Scope:
    """``scope`` as a POST to another vLLM path (no query string)."""
    return {
        **scope,
        "method": "POST",
        "path": path,
        "raw_path": path.encode("ascii"),
        "query_string": b"",
    }
