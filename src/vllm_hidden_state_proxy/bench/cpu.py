"""CPU time per request: how much processor time the proxy (and vLLM) spend on one request of
each kind, from the kernel's exact per-thread accounting (``/proc/<pid>/task/*/schedstat``).

Unlike latency this hardly depends on what else the machine does, and on a 2-core machine it is
what the proxy takes away from vLLM. Each arm sends its requests back to back, one at a time;
the readings before and after bracket them.
"""

from __future__ import annotations

import itertools

from vllm_hidden_state_proxy.bench.client import CHAT_PATH, chat_body, new_client, timed_post
from vllm_hidden_state_proxy.bench.latency import Route
from vllm_hidden_state_proxy.bench.procs import tree_cpu_seconds
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import CpuCost


async def measure_cpu(
    routes: list[Route],
    model: str,
    requests: int,
    proxy_pid: int | None,
    vllm_pid: int | None,
    progress: Progress,
    first_index: int = 3_000_000,
) -> list[CpuCost]:
    indices = itertools.count(first_index)
    costs = []
    task = progress.task("CPU time per request (arms one after the other)", requests * len(routes))
    for route in routes:
        async with new_client(route.base_url, 1, route.api_key) as client:
            body = chat_body(model, next(indices), flag=route.flag)
            (await timed_post(client, CHAT_PATH, body)).require_ok(route.name)  # connect
            proxy_before = tree_cpu_seconds(proxy_pid) if proxy_pid is not None else None
            vllm_before = tree_cpu_seconds(vllm_pid) if vllm_pid is not None else None
            for _ in range(requests):
                body = chat_body(model, next(indices), flag=route.flag)
                (await timed_post(client, CHAT_PATH, body)).require_ok(route.name)
                task.advance()
            proxy_after = tree_cpu_seconds(proxy_pid) if proxy_pid is not None else None
            vllm_after = tree_cpu_seconds(vllm_pid) if vllm_pid is not None else None
        costs.append(
            CpuCost(
                arm=route.name,
                requests=requests,
                proxy_ms=_per_request(proxy_before, proxy_after, requests),
                vllm_ms=_per_request(vllm_before, vllm_after, requests),
            )
        )
    task.done()
    return costs


def _per_request(before: float | None, after: float | None, requests: int) -> float | None:
    if before is None or after is None:
        return None
    return 1e3 * (after - before) / requests
