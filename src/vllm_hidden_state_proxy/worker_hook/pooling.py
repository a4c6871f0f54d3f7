"""Mean pooling across a prompt's prefill steps, on the device, in float32.

A mean-pooled request's prompt may be computed over several steps (chunked prefill). Each step
adds its prompt rows' sum, per wanted layer, into the request's ``[layers, hidden_size]``
float32 accumulator on the hidden states' device (queued behind the forward pass, like the
copies: nothing waits). When every prompt position has been added, the accumulator divided by
the prompt length is the request's vectors, ready to be copied like any other rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest, mean_rows


@dataclass
class _Sum:
    total: Any  # float32 tensor [len(layers), hidden_size]
    covered: int = 0


class MeanPooling:
    """The running sums of the mean-pooled requests in flight, by vLLM request id."""

    def __init__(self) -> None:
        self._sums: dict[str, _Sum] = {}

    def __len__(self) -> int:
        return len(self._sums)

    def add(
        self,
        request: ScheduledRequest,
        layers: Sequence[int],
        step_layers: Mapping[int, Any],
    ) -> list[Any] | None:
        """Add this step's prompt rows of ``request``; its mean vectors (one 1-D tensor per
        layer) once the whole prompt is in, else ``None``. Raises ``MeanGap``."""
        import torch

        state = self._sums.get(request.req_id)
        rows = mean_rows(request, 0 if state is None else state.covered)
        if rows is None:
            return None
        if state is None:
            first = step_layers[layers[0]]
            total = torch.zeros(
                (len(layers), int(first.shape[1])), dtype=torch.float32, device=first.device
            )
            state = self._sums[request.req_id] = _Sum(total)
        for index, layer in enumerate(layers):
            part = step_layers[layer][rows.first : rows.end]
            state.total[index] += torch.sum(part, dim=0, dtype=torch.float32)
        state.covered = rows.covered
        if state.covered < request.num_prompt_tokens:
            return None
        del self._sums[request.req_id]
        mean = state.total / request.num_prompt_tokens
        return [mean[index] for index in range(len(layers))]

    def forget(self, req_ids: Sequence[str] | set[str]) -> None:
        for req_id in req_ids:
            self._sums.pop(req_id, None)

    def keep_only(self, req_ids: Mapping[str, Any]) -> None:
        """Drop the sums of requests that are no longer pending (finished, aborted)."""
        for req_id in [r for r in self._sums if r not in req_ids]:
            del self._sums[req_id]
