"""What each kind of state costs (issue #28): chats of ``ANSWER_TOKENS`` tokens, one at a time,
arms interleaved round-robin: ``direct`` (straight to vLLM, unflagged), and through the proxy
flagged for each pooling of :data:`KINDS` (the prompt's last state, published at prefill; the
answer's, kept step by step; every prompt or answer position, a matrix through the ring's
arena; the means of spans). The ratio to ``flagged_last`` is what each kind adds to a flagged
request; ``answer bytes`` what moved to the client.
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


#: The flagged arms' poolings (``"spans"``: the means of the bench's 4 prompt spans), each
#: with what it asks for.
KINDS = {
    "last": "the prompt's last state",
    "last_answer": "the answer's state (last_answer)",
    "all_prompt": "every prompt position (all_prompt)",
    "all_answer": "every answer position (all_answer)",
    "spans": "the means of 4 prompt spans (mean with spans)",
}


def routes(stack: ChatStack) -> list[Route]:
    direct = stack.direct("direct", f"{ANSWER_TOKENS}-token chat straight to vLLM, unflagged")
    return [direct] + [
        stack.via_proxy(f"flagged_{kind}", f"through the proxy: {what}", "base64", kind)
        for kind, what in KINDS.items()
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
