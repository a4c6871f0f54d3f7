"""Read a step's batch layout and hidden states from vLLM's two model runners.

Both runners keep the step's full ``hidden_states`` (final norm applied, one row per scheduled
token) in ``runner.execute_model_state`` between ``execute_model()`` and ``sample_tokens()``.
The hook runs right after ``execute_model()`` returns, so the batch layout it reads is the one
that produced those rows.

- **V1** (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, also the CPU runner's base):
  batch order is ``input_batch.req_ids``; per batch index ``i``:
  ``query_start_loc.np[i]``, ``input_batch.num_computed_tokens_cpu[i]``,
  ``input_batch.num_prompt_tokens[i]``; tokens scheduled from
  ``scheduler_output.num_scheduled_tokens[req_id]``.
- **V2** (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, GPU default in vLLM >= 0.32):
  ``execute_model_state.input_batch`` holds ``req_ids``, ``query_start_loc_np``,
  ``num_computed_tokens_np`` and ``num_scheduled_tokens`` in batch order and ``idx_mapping_np``
  into the persistent ``req_states``, whose ``prompt_len.np`` gives the prompt length.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from vllm_hidden_state_proxy.worker_hook.compat import (
    missing_fields,
    scheduler_problems,
    unwrapped_methods,
)
from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest


class RunnerView(Protocol):
    """How the capture reads one runner kind."""

    name: str

    def class_problems(self) -> list[str]:
        """What the vLLM classes this view reads lack (empty if nothing); run when a runner is
        constructed, before any step."""
        ...

    def check(self, runner: Any) -> None:
        """Raise ``UnsupportedRunner`` if the runner lacks what this view reads.

        Run once at startup, so that a vLLM whose internals moved disables the hook loudly
        (no ring: the proxy answers 503) instead of failing on the first flagged request.
        """
        ...

    def scheduled(
        self, runner: Any, scheduler_output: Any, wanted: Collection[str]
    ) -> list[ScheduledRequest]: ...


class UnsupportedRunner(Exception):
    """The model runner does not have the state this hook reads (another vLLM version?)."""


class RefusedSettings(Exception):
    """The server runs in a way the hook cannot serve vectors for (a pooling model, prefill
    context parallelism): the operator's settings, not vLLM's internals, must change."""


def _require(obj: Any, where: str, names: Collection[str]) -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise UnsupportedRunner(f"{where} has no {', '.join(missing)}")


def _require_type(value: Any, where: str, kind: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, kind):
        raise UnsupportedRunner(f"{where} is a {type(value).__name__}, not {what}")


def _field_problems(cls: Any, where: str, names: Collection[str]) -> list[str]:
    missing = missing_fields(cls, names)
    return [f"{where} has no field {', '.join(missing)}"] if missing else []


def structure_problems(runner_cls: type, view: RunnerView) -> list[str]:
    """What ``runner_cls`` and the vLLM classes ``view`` reads lack (empty: nothing): the
    class-level half of the startup checks (see :mod:`.compat`)."""
    return [*unwrapped_methods(runner_cls), *scheduler_problems(), *view.class_problems()]


def step_layers(runner: Any, final_layer: int, aux_ids: Sequence[int]) -> dict[int, Any]:
    """The last step's full hidden states by layer: the final layer (``final_layer``, after the
    final norm) and the auxiliary outputs of ``aux_ids``. Both runners keep them in
    ``execute_model_state`` between ``execute_model()`` and ``sample_tokens()``.

    Called only for a step that computed tokens of a flagged request on the publishing rank,
    where both runners keep that state (``RunnerView.check`` required the attribute at
    startup, and pooling runners, which keep none, are refused then). So a missing state is
    an error, not a step to skip: skipping would leave the request to time out at the proxy.
    Raises ``RuntimeError`` then, and if the auxiliary outputs are not the ones asked for.
    """
    state = runner.execute_model_state
    if state is None or state.hidden_states is None:
        raise RuntimeError(
            "vLLM kept no hidden states (execute_model_state) for a step that computed a "
            "flagged request's prompt"
        )
    layers = {final_layer: state.hidden_states}
    if aux_ids:
        aux = state.aux_hidden_states
        if aux is None or len(aux) != len(aux_ids):
            raise RuntimeError(
                f"the model returned {0 if aux is None else len(aux)} auxiliary hidden states, "
                f"not the {len(aux_ids)} of layers {list(aux_ids)}"
            )
        layers.update(zip(aux_ids, aux, strict=True))
    return layers


class V1RunnerView:
    name = "v1"

    def class_problems(self) -> list[str]:
        state_class = _v1_state_class()
        if state_class is None:  # vLLM >= 0.34 removed V1: no V1 runner can exist there
            return ["this vLLM has no V1 model runner (vllm.v1.worker.gpu_model_runner)"]
        return _field_problems(
            state_class, "ExecuteModelState (V1)", ["hidden_states", "aux_hidden_states"]
        )

    def check(self, runner: Any) -> None:
        import numpy as np

        _require(
            runner,
            "the V1 model runner",
            ["input_batch", "query_start_loc", "vllm_config", "execute_model_state"],
        )
        _require(runner.query_start_loc, "query_start_loc", ["np"])
        batch = runner.input_batch
        _require(
            batch,
            "the V1 input batch",
            ["req_id_to_index", "num_computed_tokens_cpu", "num_prompt_tokens"],
        )
        _require_type(runner.query_start_loc.np, "query_start_loc.np", np.ndarray, "an array")
        _require_type(batch.req_id_to_index, "input_batch.req_id_to_index", Mapping, "a mapping")
        for name in ("num_computed_tokens_cpu", "num_prompt_tokens"):
            _require_type(getattr(batch, name), f"input_batch.{name}", np.ndarray, "an array")
        for problem in self.class_problems():
            raise UnsupportedRunner(problem)

    def scheduled(
        self, runner: Any, scheduler_output: Any, wanted: Collection[str]
    ) -> list[ScheduledRequest]:
        batch = runner.input_batch
        query_start_loc = runner.query_start_loc.np
        num_scheduled = scheduler_output.num_scheduled_tokens
        found = []
        for req_id in wanted:
            index = batch.req_id_to_index.get(req_id)
            scheduled = num_scheduled.get(req_id)
            if index is None or scheduled is None:
                continue
            found.append(
                ScheduledRequest(
                    req_id=req_id,
                    query_start=int(query_start_loc[index]),
                    num_computed=int(batch.num_computed_tokens_cpu[index]),
                    num_scheduled=int(scheduled),
                    num_prompt_tokens=int(batch.num_prompt_tokens[index]),
                )
            )
        return found


class V2RunnerView:
    name = "v2"

    def class_problems(self) -> list[str]:
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import ExecuteModelState

        return _field_problems(
            InputBatch,
            "InputBatch (V2)",
            [
                "req_ids",
                "num_reqs",
                "idx_mapping_np",
                "query_start_loc_np",
                "num_computed_tokens_np",
                "num_scheduled_tokens",
            ],
        ) + _field_problems(
            ExecuteModelState,
            "ExecuteModelState (V2)",
            ["input_batch", "hidden_states", "aux_hidden_states"],
        )

    def check(self, runner: Any) -> None:
        import numpy as np

        _require(
            runner, "the V2 model runner", ["req_states", "vllm_config", "execute_model_state"]
        )
        _require(runner.req_states, "the V2 request states", ["prompt_len"])
        _require(runner.req_states.prompt_len, "req_states.prompt_len", ["np"])
        _require_type(
            runner.req_states.prompt_len.np, "req_states.prompt_len.np", np.ndarray, "an array"
        )
        for problem in self.class_problems():
            raise UnsupportedRunner(problem)

    def scheduled(
        self, runner: Any, scheduler_output: Any, wanted: Collection[str]
    ) -> list[ScheduledRequest]:
        state = runner.execute_model_state
        if state is None:
            return []
        batch = state.input_batch
        prompt_len = runner.req_states.prompt_len.np
        found = []
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            if req_id not in wanted:
                continue
            found.append(
                ScheduledRequest(
                    req_id=req_id,
                    query_start=int(batch.query_start_loc_np[i]),
                    num_computed=int(batch.num_computed_tokens_np[i]),
                    num_scheduled=int(batch.num_scheduled_tokens[i]),
                    num_prompt_tokens=int(prompt_len[batch.idx_mapping_np[i]]),
                )
            )
        return found


class UnattachedRunnerView:
    """Stands for a model runner class the hook did not attach to (one it does not know, or
    one vLLM moved to another module); only its failure note uses it (``label``)."""

    def __init__(self, runner_cls: type) -> None:
        self.name = f"{runner_cls.__module__}.{runner_cls.__qualname__}"
        self.label = f"model runner {runner_cls.__qualname__}"

    def _refuse(self) -> UnsupportedRunner:
        return UnsupportedRunner(f"the hook cannot read the model runner {self.name}")

    def class_problems(self) -> list[str]:
        return [str(self._refuse())]

    def check(self, runner: Any) -> None:
        raise self._refuse()

    def scheduled(
        self, runner: Any, scheduler_output: Any, wanted: Collection[str]
    ) -> list[ScheduledRequest]:
        raise self._refuse()


def _v1_state_class() -> Any:
    """V1's ``ExecuteModelState``, or None where vLLM has no V1 runner (0.34 removed it)."""
    try:
        from vllm.v1.worker.gpu_model_runner import ExecuteModelState
    except ModuleNotFoundError as missing:
        if missing.name not in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker"):
            raise
        return None
    return ExecuteModelState
