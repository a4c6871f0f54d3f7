"""What each kind of state costs (issue #28): chats of ``ANSWER_TOKENS`` tokens, one at a time,
arms interleaved round-robin: ``direct`` (straight to vLLM, unflagged), and through the proxy
flagged for the prompt's last state (``flagged_last``, published at prefill), the answer's
(``flagged_last_answer``: the hook keeps each decode step's row and publishes the latest when
the answer finishes), every prompt position (``flagged_all_prompt``: a matrix through the
ring's arena, a full prefill), every answer position (``flagged_all_answer``), and the means of
4 prompt spans (``flagged_spans``, pooled in the worker). The ratio to ``flagged_last`` is what
each kind adds to a flagged request; ``answer bytes`` what moved to the client.
"""

from __future__ import annotations

from vllm_hidden_state_proxy.bench.client import ChatStack, Route
from vllm_hidden_state_proxy.bench.latency import one_at_a_time
from vllm_hidden_state_proxy.bench.options import BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table, summary_cells
from vllm_hidden_state_proxy.bench.stats import ratio

#: Tokens per answer (``ignore_eos``: exactly that many).
ANSWER_TOKENS = 16
TITLE = f"Answers: {ANSWER_TOKENS}-token chats, one request at a time, arms interleaved"


def routes(stack: ChatStack) -> list[Route]:
    return [
        stack.direct("direct", f"{ANSWER_TOKENS}-token chat straight to vLLM, unflagged"),
        stack.via_proxy("flagged_last", "through the proxy: the prompt's last state", "base64"),
        stack.via_proxy(
            "flagged_last_answer",
            "through the proxy: the answer's state (last_answer)",
            "base64",
            "last_answer",
        ),
        stack.via_proxy(
            "flagged_all_prompt",
            "through the proxy: every prompt position (all_prompt)",
            "base64",
            "all_prompt",
        ),
        stack.via_proxy(
            "flagged_all_answer",
            "through the proxy: every answer position (all_answer)",
            "base64",
            "all_answer",
        ),
        stack.via_proxy(
            "flagged_spans",
            "through the proxy: the means of 4 prompt spans (mean with spans)",
            "base64",
            "spans",
        ),
    ]


async def run(stack: ChatStack, options: BenchOptions, progress: Progress) -> Table:
    """A quarter of ``--requests`` per arm."""
    arms = routes(stack)
    found = await one_at_a_time(
        stack,
        arms,
        max(1, options.requests // 4),
        options.warmup,
        progress,
        what="answers",
        first_index=5_000_000,
        max_tokens=ANSWER_TOKENS,
    )
    direct, last = found["direct"][0].p50, found["flagged_last"][0].p50
    rows: list[Row] = []
    for route in arms:
        summary, size = found[route.name]
        row: Row = {"arm": route.name, "what": route.description, **summary_cells(summary)}
        row["p50 / direct"] = ratio(summary.p50, direct)
        if route.pooling != "last":
            row["p50 / flagged_last"] = ratio(summary.p50, last)
        row["answer bytes"] = size
        rows.append(row)
    return Table(TITLE, rows)
