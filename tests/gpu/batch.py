"""A vLLM-free stand-in for vLLM V2's model runner, its scheduler's output and its engine loop.

The CUDA machines these tests run on have torch but no vLLM, so nothing here imports it (unlike
``tests/worker_hook/fakes.py``, which builds vLLM's own ``SchedulerOutput``): the objects carry
exactly the fields the hook reads, under vLLM's names, and ``test_fakes.py`` checks those names
against vLLM's own classes wherever vLLM is installed.

- :class:`FakeV2Runner`: what :class:`~vllm_hidden_state_proxy.worker_hook.runners.V2RunnerView`
  reads (``execute_model_state.input_batch``, ``req_states.prompt_len.np``), with the step's
  hidden states as views of the :class:`~tests.gpu.model.MatmulModel`'s static buffers;
- :class:`StepOutput`: V2's ``AsyncOutput``: its event recorded on a copy stream that waited for
  the main stream after the step, ``get_output()`` waits for it;
- :class:`Engine`: V2's order with async scheduling: ``execute_model`` (the hook after it),
  ``sample_tokens`` (the hook after it), and the output of step N collected only after later
  steps were enqueued (``lag``), on the host, as vLLM's output thread does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tests.gpu.devices import sleep_on_stream
from tests.gpu.model import MatmulModel, seed_of
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture


@dataclass(frozen=True)
class Scheduled:
    """One request's tokens in a step: positions ``computed .. computed + scheduled - 1``."""

    req_id: str
    prompt_len: int
    computed: int
    scheduled: int
    #: Whose prompt it is: ``n > 1`` siblings share their prompt's rows.
    prompt_id: str

    def identity(self, position: int) -> str:
        """Whose row a position is: the prompt's, then (its answer) the request's own."""
        return self.prompt_id if position < self.prompt_len else self.req_id


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (or, on V2, resumed after preemption)."""

    extra_args: dict[str, Any] | None
    max_tokens: int = 16


@dataclass(frozen=True)
class Step:
    batch: list[Scheduled]
    new: dict[str, NewRequest] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


# -- vLLM's objects, the fields the hook reads --------------------------------------------------


@dataclass(frozen=True)
class FakeSamplingParams:
    extra_args: dict[str, Any] | None
    max_tokens: int


@dataclass(frozen=True)
class FakeNewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: FakeSamplingParams
    num_computed_tokens: int


@dataclass(frozen=True)
class FakeSchedulerOutput:
    scheduled_new_reqs: list[FakeNewRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]


@dataclass(frozen=True)
class FakeInputBatch:
    """V2's ``InputBatch``: batch order, and ``idx_mapping_np`` into the request states."""

    req_ids: list[str]
    num_reqs: int
    idx_mapping_np: np.ndarray[Any, Any]
    query_start_loc_np: np.ndarray[Any, Any]
    num_computed_tokens_np: np.ndarray[Any, Any]
    num_scheduled_tokens: np.ndarray[Any, Any]


@dataclass(frozen=True)
class FakeExecuteModelState:
    """V2's ``ExecuteModelState``: the three fields the hook reads."""

    input_batch: FakeInputBatch
    hidden_states: Any
    aux_hidden_states: Any


@dataclass
class _Array:
    np: np.ndarray[Any, Any]


@dataclass
class FakeRequestStates:
    prompt_len: _Array


def scheduler_output(step: Step) -> FakeSchedulerOutput:
    new = []
    for item in step.batch:
        request = step.new.get(item.req_id)
        if request is None:
            continue
        new.append(
            FakeNewRequestData(
                item.req_id,
                list(range(item.prompt_len)),
                FakeSamplingParams(request.extra_args, request.max_tokens),
                item.computed,
            )
        )
    scheduled = {item.req_id: item.scheduled for item in step.batch}
    return FakeSchedulerOutput(new, scheduled, sum(scheduled.values()), set(step.finished))


class FakeV2Runner:
    """The state of vLLM V2's ``GPUModelRunner`` that the hook reads, step after step."""

    def __init__(self, model: MatmulModel, capacity: int = 1 << 14) -> None:
        self.model = model
        self.vllm_config = None  # read by V2RunnerView.check only
        self.req_states = FakeRequestStates(_Array(np.zeros(capacity, dtype=np.int32)))
        self.execute_model_state: FakeExecuteModelState | None = None
        self._index: dict[str, int] = {}
        self._next_index = 0

    def execute_model(self, step: Step) -> FakeSchedulerOutput:
        """Lay out the step (V2's persistent request states first), run the model into its
        static buffers on the current stream, and keep the state until ``sample_tokens``."""
        output = scheduler_output(step)
        for req_id in step.finished:
            self._index.pop(req_id, None)
        for item in step.batch:
            if item.req_id in step.new or item.req_id not in self._index:
                self._index[item.req_id] = self._next_index
                self.req_states.prompt_len.np[self._next_index] = item.prompt_len
                self._next_index += 1
        seeds: list[int] = []
        starts = []
        for item in step.batch:
            starts.append(len(seeds))
            seeds.extend(
                seed_of(item.identity(position), position)
                for position in range(item.computed, item.computed + item.scheduled)
            )
        if not seeds:  # V2 returns before the forward when nothing is scheduled
            self.execute_model_state = None
            return output
        count = len(step.batch)
        batch = FakeInputBatch(
            req_ids=[item.req_id for item in step.batch],
            num_reqs=count,
            idx_mapping_np=np.array([self._index[i.req_id] for i in step.batch], dtype=np.int32),
            query_start_loc_np=np.array([*starts, len(seeds)], dtype=np.int32),
            num_computed_tokens_np=np.array([i.computed for i in step.batch], dtype=np.int32),
            num_scheduled_tokens=np.array([i.scheduled for i in step.batch], dtype=np.int32),
        )
        with torch.inference_mode():  # as vLLM's execute_model
            tokens = self.model.forward(seeds)
            hidden, aux = self.model.layers(tokens)
        self.execute_model_state = FakeExecuteModelState(batch, hidden, aux)
        return output

    def sample_tokens(self, copy_stream: Any) -> StepOutput:
        self.execute_model_state = None
        return StepOutput(self.model.device, copy_stream)


class StepOutput:
    """V2's ``AsyncOutput``: the step's output, ready once its copy stream's event is."""

    def __init__(self, device: Any, copy_stream: Any) -> None:
        self.event: Any = None
        if device.type == "cuda":
            main = torch.cuda.current_stream(device)
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_stream(main)
                self.event = torch.cuda.Event(blocking=True)
                self.event.record(copy_stream)

    def get_output(self) -> str:
        if self.event is not None:
            self.event.synchronize()
        return "model-runner-output"


class Engine:
    """Steps a runner and its capture in vLLM V2's order, with async scheduling.

    ``lag`` outputs stay uncollected: the replays of steps N + 1 .. N + lag are enqueued before
    the output of step N is collected (and with it, the hook publishes step N's copies).
    ``device_lag_us`` keeps the device that far behind the host at every step (CUDA), so those
    copies are really in flight when the next steps overwrite the static buffers.

    On CUDA the hook's ``after_execute_model`` runs under ``torch.cuda.set_sync_debug_mode
    ("error")``: an operation there that makes the host wait for the device (a blocking copy,
    ``.item()``) raises, and the hook answers the step's requests with error records, which
    the tests see. The main thread must never wait: vLLM schedules the next step meanwhile.
    """

    def __init__(
        self,
        runner: FakeV2Runner,
        capture: StepCapture,
        *,
        lag: int = 2,
        device_lag_us: float = 0.0,
    ) -> None:
        self.runner = runner
        self.capture = capture
        self.lag = lag
        self.device_lag_us = device_lag_us
        device = runner.model.device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: Each uncollected output, with the newest copy its step had started.
        self._outputs: deque[tuple[StepOutput, int]] = deque()
        #: How many outputs were collected while copies of their own step were unpublished:
        #: ``lag`` steps later, the main thread (which polls, never waits) had still not seen
        #: them complete, so the host ran that far ahead of the device.
        self.collected_unpublished = 0

    def step(self, step: Step) -> None:
        sleep_on_stream(self.runner.model.device, self.device_lag_us)
        output = self.runner.execute_model(step)
        with _no_host_waits(self.runner.model.device):
            self.capture.after_execute_model(self.runner, output)
        if output.total_num_scheduled_tokens:
            sampled = self.runner.sample_tokens(self.copy_stream)
            self.capture.after_sample_tokens(sampled)
            publications = self.capture.publications
            through = 0 if publications is None else publications.last_number
            self._outputs.append((sampled, through))
        while len(self._outputs) > self.lag:
            self._collect()

    def run(self, steps: Iterable[Step]) -> None:
        for step in steps:
            self.step(step)
        self.finish()

    def _collect(self) -> None:
        output, through = self._outputs.popleft()
        publications = self.capture.publications
        if publications is not None:
            entries = publications._entries  # the queue's oldest unpublished copy
            if entries and entries[0].number <= through:
                self.collected_unpublished += 1
        output.get_output()  # as vLLM's output thread does

    def finish(self) -> None:
        while self._outputs:
            self._collect()
        publications = self.capture.publications
        if publications is not None:
            publications.publish_through(publications.last_number)


@contextmanager
def _no_host_waits(device: Any) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def most_tokens(steps: Iterable[Step]) -> int:
    """The most tokens any of ``steps`` computes (the static size a model needs for them)."""
    return max((sum(item.scheduled for item in step.batch) for step in steps), default=1)
