"""What one input may cost a run: the bounds on an answer, a request body and a line.

- An **answer** is read up to :func:`answer_limit` bytes, counted decoded (a gzip body of a few
  hundred KiB can decode to a GiB): what the request can carry, its vectors (or, for matrices,
  the proxies' largest record per entry) in base64, plus :data:`VLLM_ANSWER_BYTES` of vLLM's own
  answer (the proxy's ``--max-answer-size`` at its default: it refuses a longer one). Past it,
  the input fails. ``--max-answer-size`` sets it outright (for a batch, that many bytes per
  input).
- A **request body** is at most what the proxies take (their capture description's
  ``max_body_bytes``, the smallest of them): a longer one fails before it is sent.
- A JSONL **line** longer than that is not read (no request of it could be sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hidden_state_proxy.client import Capture
from vllm_hidden_state_proxy.extract.inputs import DEFAULT_MAX_LINE_BYTES
from vllm_hidden_state_proxy.protocol import ANSWER_POOLINGS

#: vLLM's part of an answer the proxy passes on: its ``--max-answer-size`` by default.
VLLM_ANSWER_BYTES = 64 * 1024 * 1024
#: An entry's info and JSON around its arrays.
_ENTRY_BYTES = 64 * 1024


def _base64_bytes(raw: int) -> int:
    return (raw + 2) // 3 * 4


def answer_limit(plan: Mapping[str, Any], *, max_record_bytes: int, inputs: int = 1) -> int:
    """The most bytes an answer to one of the plan's requests for ``inputs`` inputs (a batch)
    can hold (see the module)."""
    entries = inputs * (plan["n"] if plan["pooling"] in ANSWER_POOLINGS else 1)
    if plan["matrix"]:
        per_entry = max_record_bytes  # all of one entry's layers, float32
    else:
        per_entry = len(plan["layers"]) * plan["hidden_size"] * 4
    return VLLM_ANSWER_BYTES + entries * (_base64_bytes(per_entry) + _ENTRY_BYTES)


def body_limit(captures: Sequence[Capture]) -> int:
    """The largest request body every proxy takes (their ``max_body_bytes``)."""
    limits = [c.limits.get("max_body_bytes", DEFAULT_MAX_LINE_BYTES) for c in captures]
    return min(limits, default=DEFAULT_MAX_LINE_BYTES)
