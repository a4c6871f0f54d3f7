"""Send several flagged requests for one client request, a bounded number at a time.

Used for a flagged list of completions prompts and for embeddings inputs. The first failure
(a ``ProxyError`` or a vLLM answer other than 200) cancels what is still in flight; the caller
reports the first failure in input order, so a client never gets a partial list.
"""

from __future__ import annotations

from typing import Any

import anyio

from vllm_hidden_state_proxy.proxy.asgi import Scope
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.flagged import JsonAnswer, fetch_flagged_json
from vllm_hidden_state_proxy.proxy.state import ProxyState

#: One upstream request: the scope it is sent as (method, path, headers) and its JSON body.
Job = tuple[Scope, dict[str, Any]]
Outcome = JsonAnswer | ProxyError | None  # None: cancelled after another input failed


async def fetch_all(state: ProxyState, jobs: list[Job]) -> list[Outcome]:
    """Every job's outcome, in job order; at most ``settings.fan_out_limit`` in flight."""
    results: list[Outcome] = [None] * len(jobs)
    limiter = anyio.CapacityLimiter(state.settings.fan_out_limit)

    async with anyio.create_task_group() as group:

        async def one(index: int, scope: Scope, document: dict[str, Any]) -> None:
            async with limiter:
                try:
                    answer = await fetch_flagged_json(state, scope, document)
                except ProxyError as error:
                    results[index] = error
                    group.cancel_scope.cancel()
                    return
                results[index] = answer
                if answer.status != 200:
                    group.cancel_scope.cancel()

        for index, (scope, document) in enumerate(jobs):
            group.start_soon(one, index, scope, document)
    return results


def first_failure(results: list[Outcome]) -> tuple[int, JsonAnswer | ProxyError] | None:
    """The first failed job in job order, with its index; ``None`` if all succeeded."""
    for index, result in enumerate(results):
        if isinstance(result, ProxyError) or (
            isinstance(result, JsonAnswer) and result.status != 200
        ):
            return index, result
    return None


def answers(results: list[Outcome]) -> list[JsonAnswer]:
    """The 200 answers of a fan-out without failures (asserts each has its vector)."""
    complete = [r for r in results if isinstance(r, JsonAnswer)]
    assert len(complete) == len(results)
    assert all(a.completion is not None and a.record is not None for a in complete)
    return complete


def at_path(scope: Scope, path: str) -> Scope:
    """``scope`` as a POST to another vLLM path (no query string)."""
    return {
        **scope,
        "method": "POST",
        "path": path,
        "raw_path": path.encode("ascii"),
        "query_string": b"",
    }
