"""The poolings over every prompt position, across a prompt's prefill steps, on the device.

A request's prompt may be computed over several steps (chunked prefill); which rows of a step
extend it, and the gap left by the prefix cache, are :func:`.selection.mean_rows`'s.

- ``"mean"`` (:class:`MeanPooling`): each step adds its prompt rows' sum, per wanted layer,
  into the request's ``[layers, hidden_size]`` float32 accumulator on the hidden states' device
  (queued behind the forward pass, like the copies: nothing waits). When every prompt position
  has been added, the accumulator divided by the prompt length is the request's vectors, ready
  to be copied like any other rows.
- ``"all_prompt"`` (:class:`PromptMatrix`): each step keeps a copy of its prompt rows,
  ``[layers, rows, hidden_size]`` in the model's dtype (the step's hidden states are
  overwritten by the next); the last one joins them into the ``[layers * P, hidden_size]``
  matrix that is copied to the host. What they may take is :mod:`.matrix_budget`'s.
- ``"spans"`` (:class:`SpanPooling`): the mean of each given span of prompt positions. Each
  step adds, per layer, its rows' sums within each span into a ``[layers, spans, hidden_size]``
  float32 accumulator: from a running sum of the step's rows (``cumsum``, one layer at a time,
  so a step holds one ``[rows + 1, hidden_size]`` float32 sum), two gathers per layer and step
  whatever the span count; the last step divides by the spans' lengths. Only the pooled rows
  travel. What these keep on the device is counted (:mod:`.matrix_budget`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest, mean_rows

S = TypeVar("S")


class _InFlight(Generic[S]):
    """Per-request state of the requests in flight, by vLLM request id."""

    def __init__(self) -> None:
        self._state: dict[str, S] = {}

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._state

    def forget(self, req_ids: Sequence[str] | set[str]) -> None:
        for req_id in req_ids:
            self._state.pop(req_id, None)

    def keep_only(self, req_ids: Mapping[str, Any]) -> None:
        """Drop the state of requests that are no longer pending (finished, aborted)."""
        for req_id in [r for r in self._state if r not in req_ids]:
            del self._state[req_id]


@dataclass
class _Parts:
    parts: list[Any]  # tensors [len(layers), rows, hidden_size]
    covered: int = 0


class PromptMatrix(_InFlight[_Parts]):
    """The kept prompt rows of the ``"all_prompt"`` requests in flight, by vLLM request id."""

    def add(
        self,
        request: ScheduledRequest,
        layers: Sequence[int],
        step_layers: Mapping[int, Any],
    ) -> Any | None:
        """Keep this step's prompt rows of ``request``; once the whole prompt is in, its
        ``[len(layers) * P, hidden_size]`` matrix (layer after layer), else ``None``. Raises
        ``MeanGap``."""
        import torch

        state = self._state.get(request.req_id)
        rows = mean_rows(request, 0 if state is None else state.covered)
        if rows is None:
            return None
        if state is None:
            state = self._state[request.req_id] = _Parts([])
        # torch.stack copies: the step's hidden states are overwritten by the next step.
        state.parts.append(
            torch.stack([step_layers[layer][rows.first : rows.end] for layer in layers])
        )
        state.covered = rows.covered
        if state.covered < request.num_prompt_tokens:
            return None
        del self._state[request.req_id]
        joined = state.parts[0] if len(state.parts) == 1 else torch.cat(state.parts, dim=1)
        return joined.reshape(len(layers) * request.num_prompt_tokens, joined.shape[-1])


@dataclass
class _SpanSums:
    total: Any  # float32 tensor [len(layers), len(spans), hidden_size]
    starts: Any  # int64 tensors [len(spans)] on the same device
    ends: Any
    covered: int = 0


class SpanError(Exception):
    """A span the prompt does not have (it ends past the prompt's last position)."""


class SpanPooling(_InFlight[_SpanSums]):
    """The running span sums of the ``"spans"`` requests in flight, by vLLM request id."""

    def add(
        self,
        request: ScheduledRequest,
        layers: Sequence[int],
        spans: Sequence[tuple[int, int]],
        step_layers: Mapping[int, Any],
    ) -> Any | None:
        """Add this step's prompt rows of ``request`` to its spans; once the whole prompt is
        in, the ``[len(layers) * len(spans), hidden_size]`` means (layer after layer), else
        ``None``. Raises ``MeanGap``, and ``SpanError`` for a span past the prompt."""
        import torch

        state = self._state.get(request.req_id)
        rows = mean_rows(request, 0 if state is None else state.covered)
        if rows is None:
            return None
        first_layer = step_layers[layers[0]]
        if state is None:
            prompt = request.num_prompt_tokens
            outside = [span for span in spans if span[1] > prompt]
            if outside:
                raise SpanError(
                    f"span {list(outside[0])} ends past the prompt's {prompt} tokens (spans "
                    f"are [start, end) token positions of the prompt, 0 <= start < end <= {prompt})"
                )
            device = first_layer.device
            state = self._state[request.req_id] = _SpanSums(
                torch.zeros(
                    (len(layers), len(spans), int(first_layer.shape[1])),
                    dtype=torch.float32,
                    device=device,
                ),
                _positions([start for start, _ in spans], device),
                _positions([end for _, end in spans], device),
            )
        count = rows.end - rows.first
        begin = rows.covered - count  # the prompt position of the step's first added row
        lower = (state.starts - begin).clamp(0, count)
        upper = (state.ends - begin).clamp(0, count)
        # One layer's running sum at a time: [count + 1, hidden] float32 is the most a step
        # adds on the device (what the device budget counts), whatever the layer count.
        running = torch.zeros(
            (count + 1, int(first_layer.shape[1])), dtype=torch.float32, device=first_layer.device
        )
        for index, layer in enumerate(layers):
            torch.cumsum(
                step_layers[layer][rows.first : rows.end],
                dim=0,
                dtype=torch.float32,
                out=running[1:],
            )
            state.total[index] += running[upper] - running[lower]
        state.covered = rows.covered
        if state.covered < request.num_prompt_tokens:
            return None
        del self._state[request.req_id]
        lengths = (state.ends - state.starts).to(torch.float32)
        means = state.total / lengths[None, :, None]
        return means.reshape(len(layers) * len(spans), means.shape[-1])


def _positions(values: list[int], device: Any) -> Any:
    """``values`` as an int64 tensor on ``device``, the host not waiting for the device: a
    ``torch.tensor(values, device=...)`` is a blocking copy, which on a GPU waits for every
    step queued on the stream (the main thread would stall, and async scheduling with it)."""
    import torch

    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return host
    # From pinned memory, copied in stream order; torch keeps the pinned block until then.
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class _Sum:
    total: Any  # float32 tensor [len(layers), hidden_size]
    covered: int = 0


class MeanPooling(_InFlight[_Sum]):
    """The running sums of the mean-pooled requests in flight, by vLLM request id."""

    def add(
        self,
        request: ScheduledRequest,
        layers: Sequence[int],
        step_layers: Mapping[int, Any],
    ) -> list[Any] | None:
        """Add this step's prompt rows of ``request``; its mean vectors (one 1-D tensor per
        layer) once the whole prompt is in, else ``None``. Raises ``MeanGap``."""
        import torch

        state = self._state.get(request.req_id)
        rows = mean_rows(request, 0 if state is None else state.covered)
        if rows is None:
            return None
        if state is None:
            first = step_layers[layers[0]]
            total = torch.zeros(
                (len(layers), int(first.shape[1])), dtype=torch.float32, device=first.device
            )
            state = self._state[request.req_id] = _Sum(total)
        for index, layer in enumerate(layers):
            part = step_layers[layer][rows.first : rows.end]
            state.total[index] += torch.sum(part, dim=0, dtype=torch.float32)
        state.covered = rows.covered
        if state.covered < request.num_prompt_tokens:
            return None
        del self._state[request.req_id]
        mean = state.total / request.num_prompt_tokens
        return [mean[index] for index in range(len(layers))]
