"""Send several keyed requests for one client request, a bounded number at a time.

Used for a flagged list of completions prompts and for embeddings inputs. The first failure
(a ``ProxyError`` or a vLLM answer other than 200) cancels what is still in flight; the caller
reports the first failure in input order, so a client never gets a partial list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import Scope

from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.keyed_exchange import (
    AnswerBudget,
    JoinableAnswer,
    VllmAnswer,
    fetch_keyed_json,
)
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.lookup import WantedVectors

#: One upstream request: the scope it is sent as (method, path, headers) and its JSON body.
Job = tuple[Scope, dict[str, Any]]


@dataclass(frozen=True)
class Failed:
    """The first job in input order that failed, and how."""

    index: int
    failure: VllmAnswer | ProxyError


async def fetch_all(
    state: ProxyState, jobs: list[Job], wanted: WantedVectors
) -> list[JoinableAnswer] | Failed:
    """Every job's answer in job order, or the first failure; at most ``fan_out_limit`` in
    flight."""
    results: list[JoinableAnswer | VllmAnswer | ProxyError | None] = [None] * len(jobs)
    limiter = anyio.CapacityLimiter(state.settings.fan_out_limit)
    budget = AnswerBudget(state.settings.max_answer_bytes)  # the merged answer's bound too

    async with anyio.create_task_group() as group:

        async def one(index: int, scope: Scope, document: dict[str, Any]) -> None:
            async with limiter:
                try:
                    answer = await fetch_keyed_json(state, scope, document, wanted, budget)
                except ProxyError as error:
                    # Without its traceback: its frames hold ``results`` (this closure's), a
                    # cycle that would keep every answer's records (matrices) in memory until
                    # the garbage collector's next full pass, long after the budget let go.
                    results[index] = error.with_traceback(None)
                    group.cancel_scope.cancel()
                    return
                results[index] = answer
                if isinstance(answer, VllmAnswer):
                    group.cancel_scope.cancel()

        for index, (scope, document) in enumerate(jobs):
            group.start_soon(one, index, scope, document)
    # ``results`` stays reachable from the finished tasks' frames (cancelled ones keep theirs
    # in their CancelledError: cycles the garbage collector frees late): empty it, so that
    # answers (their records: matrices) live only as long as the caller holds them.
    taken, results[:] = list(results), []
    answers: list[JoinableAnswer] = []
    for index, result in enumerate(taken):
        if isinstance(result, (VllmAnswer, ProxyError)):
            return Failed(index, result)
        if isinstance(result, JoinableAnswer):
            answers.append(result)
    if len(answers) != len(jobs):  # cancelled without a failure: cannot happen
        return Failed(len(answers), ProxyError(502, "a fanned-out request did not complete"))
    return answers


def at_path(scope: Scope, path: str) -> Scope:
    """``scope`` as a POST to another vLLM path (no query string)."""
    return {
        **scope,
        "method": "POST",
        "path": path,
        "raw_path": path.encode("ascii"),
        "query_string": b"",
    }
