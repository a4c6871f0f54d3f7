"""The answer's state (pooling ``"last_answer"``): each choice's latest computed positions, kept
on the device while it runs, published when it finishes.

A step that computes positions ``nc .. nc + ns - 1`` of a request samples its next token from
the state at ``nc + ns - 1``: the request's **sampling position** in that step (the last prompt
position, then one per decode step). The state that chose an answer's final token ``C`` is the
one at ``P + C - 2``. The hook cannot tell which step that is: vLLM's scheduler sees the stop
only after the step that sampled it, and with async scheduling has by then run the next one
(a ``stop`` string is found later still, in vLLM's front end). So, for each choice:

- every step that computes its sampling position copies that row of each wanted layer (one
  ``[layers, hidden]`` tensor, queued on the device behind the forward like the other copies;
  nothing waits), and keeps the latest :data:`~vllm_hidden_state_proxy.protocol.ANSWER_WINDOW`
  positions (a recomputation after preemption replaces the same position);
- when the choice finishes (its id in ``scheduler_output.finished_req_ids`` of a later step;
  vLLM keeps stepping while finished ids are pending, so this comes on an idle server too),
  each kept position ``p`` is published as a record under
  ``answer_key(key, choice, p - P + 2)``: the proxy, which knows the answer's token count,
  looks up the one it needs.

With ``"all_answer"`` a choice keeps every sampling position (up to ``max_tokens`` of them:
the ones past it choose no token) and publishes one matrix record under
``all_answer_key(key, choice)``, its rows from the last prompt position on; the proxy keeps as
many as the answer has tokens (a step computed past the stop adds rows it drops).

Each choice of ``n > 1`` is a child request ``"{index}_{parent id}"`` in vLLM
(``vllm/v1/engine/parallel_sampling.py``); the proxy sends ``n`` as the choices entry, and the
index is read from the id. Pure bookkeeping: the tensors are whatever the capture passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_hidden_state_proxy.protocol import ANSWER_WINDOW, all_answer_key, answer_key
from vllm_hidden_state_proxy.worker_hook.publication_queue import RecordTarget
from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest, Selection

#: Most answers tracked at once (a bound, far above vLLM's running requests).
MAX_TRACKED = 65536


def sampling_row(request: ScheduledRequest) -> tuple[int, int] | None:
    """(position, row) of the step's sampling position of ``request``, if the step computes
    one of its answer (the last prompt position or later); ``None`` for a prompt chunk before
    the last, or a step that computes nothing of it."""
    if request.num_scheduled <= 0:
        return None
    position = request.num_computed + request.num_scheduled - 1
    if position < request.num_prompt_tokens - 1:
        return None
    return position, request.query_start + request.num_scheduled - 1


def choice_index(req_id: str, choices: int) -> int | None:
    """The choice a vLLM request id is (``"{index}_{parent}"`` when ``choices > 1``), or
    ``None`` if the id is not such a child."""
    if choices <= 1:
        return 0
    head, sep, _ = req_id.partition("_")
    if not sep or not head.isdigit():
        return None
    index = int(head)
    return index if index < choices else None


@dataclass
class _Answer:
    key: bytes
    choice: int
    layers: tuple[int, ...]
    pooling: str = "last_answer"
    #: ``"all_answer"``: the most positions kept (vLLM's ``max_tokens``).
    max_rows: int | None = None
    num_prompt_tokens: int = 0
    #: Kept sampling positions -> their ``[len(layers), hidden]`` rows, oldest first.
    rows: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishedAnswer:
    """A finished choice's records: ``rows`` (one 1-D tensor per layer, position after
    position; for a matrix, one 2-D tensor) become ``targets``; no targets if none of its
    positions was computed, or ``problem`` says why there are none."""

    key: bytes
    rows: Any
    targets: list[RecordTarget]
    problem: str | None = None


class AnswerRows:
    """The answers in flight, by vLLM request id."""

    def __init__(self, window: int = ANSWER_WINDOW, limit: int = MAX_TRACKED) -> None:
        self.window = window
        self.limit = limit
        self._answers: dict[str, _Answer] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._answers

    def ids(self) -> list[str]:
        return list(self._answers)

    def track(self, req_id: str, selection: Selection) -> str | None:
        """Start keeping ``req_id``'s rows; the problem (for an error record) if it cannot be."""
        tracked = self._answers.get(req_id)
        if tracked is not None and tracked.key == selection.key:
            return None  # resumed after preemption (V2 sends it as new again): keep its rows
        choice = choice_index(req_id, selection.choices)
        if choice is None:
            return (
                f"vLLM request {req_id!r} is not a child request '<index>_<parent>' of "
                f"{selection.choices} choices, so its choice is unknown"
            )
        if len(self._answers) >= self.limit:
            return f"more than {self.limit} answers are in flight in this vLLM worker"
        matrix = selection.pooling == "all_answer"
        self._answers[req_id] = _Answer(
            selection.key,
            choice,
            selection.layers,
            selection.pooling,
            selection.max_tokens if matrix else None,
        )
        return None

    def keep(self, request: ScheduledRequest, step_layers: Mapping[int, Any]) -> None:
        """Keep this step's sampling row of ``request`` (if tracked and computed here)."""
        import torch

        answer = self._answers.get(request.req_id)
        found = None if answer is None else sampling_row(request)
        if answer is None or found is None:
            return
        position, row = found
        if (
            answer.max_rows is not None
            and position >= request.num_prompt_tokens - 1 + answer.max_rows
        ):
            return  # past max_tokens: it chooses no token of the answer
        # torch.stack copies: the step's hidden states are overwritten by the next step.
        rows = torch.stack([step_layers[layer][row] for layer in answer.layers])
        answer.rows.pop(position, None)
        answer.rows[position] = rows
        answer.num_prompt_tokens = request.num_prompt_tokens
        while answer.pooling != "all_answer" and len(answer.rows) > self.window:
            del answer.rows[min(answer.rows)]

    def finish(self, req_ids: Iterable[str]) -> list[FinishedAnswer]:
        """The records of the tracked requests among ``req_ids``, which are forgotten."""
        finished = []
        for req_id in req_ids:
            answer = self._answers.pop(req_id, None)
            if answer is None:
                continue
            if answer.pooling == "all_answer":
                finished.append(_matrix_of(answer))
                continue
            rows: list[Any] = []
            targets = []
            for position in sorted(answer.rows):
                kept = answer.rows[position]
                rows.extend(kept[index] for index in range(len(answer.layers)))
                count = position - answer.num_prompt_tokens + 2
                targets.append(
                    RecordTarget(
                        answer_key(answer.key, answer.choice, count),
                        position=position,
                        num_prompt_tokens=answer.num_prompt_tokens,
                        layers=answer.layers,
                        pooling="last_answer",
                    )
                )
            finished.append(FinishedAnswer(answer.key, rows, targets))
        return finished

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._answers.pop(req_id, None)


def _matrix_of(answer: _Answer) -> FinishedAnswer:
    """An ``"all_answer"`` choice's one record: its kept positions from the last prompt
    position on, which must all be there."""
    import torch

    positions = sorted(answer.rows)
    if not positions:
        return FinishedAnswer(answer.key, [], [])
    first = answer.num_prompt_tokens - 1
    if positions != list(range(first, first + len(positions))):
        problem = (
            f"positions {first}..{positions[-1]} of the answer were not all computed in "
            "this vLLM worker's steps, so its matrix is incomplete"
        )
        return FinishedAnswer(answer.key, [], [], problem)
    kept = torch.stack([answer.rows[position] for position in positions], dim=1)
    matrix = kept.reshape(len(answer.layers) * len(positions), kept.shape[-1])
    target = RecordTarget(
        all_answer_key(answer.key, answer.choice),
        position=first,
        num_prompt_tokens=answer.num_prompt_tokens,
        layers=answer.layers,
        pooling="all_answer",
        rows=len(positions),
    )
    return FinishedAnswer(answer.key, matrix, [target])
