"""Per-runner capture: after each step, copy the selected rows and publish them to the ring.

It never raises into vLLM. An exception inside a wrapped ``execute_model`` would kill the engine
and every request with it, so every entry point here catches, logs once, drops the keys of the
affected step (those requests then get a clear 504 from the proxy) and carries on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..protocol import (
    DEFAULT_RING_SLOTS,
    RING_DIR_MODE_ENV,
    RING_SLOTS_ENV,
    ring_dir_from_env,
)
from .runners import RunnerView, UnsupportedRunner, step_hidden_states
from .selection import ScheduledRequest, SelectedRequests, last_prompt_row

logger = logging.getLogger("vllm.hidden_state_hook")


class _LogOnce:
    def __init__(self) -> None:
        self._seen: set[str] = set()

    def exception(self, where: str) -> None:
        if where in self._seen:
            return
        self._seen.add(where)
        logger.exception(
            "vllm-hidden-state-proxy: error in the worker hook (%s); the affected flagged "
            "requests get no vector (the proxy answers 504), vLLM keeps serving. "
            "Further errors here are not logged.",
            where,
        )


def _is_publishing_rank() -> bool:
    """Only tensor-parallel rank 0 of the last pipeline stage publishes."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return bool(get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank)


def _check_parallelism(vllm_config: Any) -> None:
    """Refuse layouts where a rank's step state is not the whole batch."""
    size = int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)
    if size > 1:
        raise UnsupportedRunner(
            f"prefill_context_parallel_size={size}: prefill context parallelism splits each "
            "step's batch across ranks, which this hook does not support yet"
        )


def _data_parallel_rank(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)


def _ring_modes() -> tuple[int, int]:
    raw = os.environ.get(RING_DIR_MODE_ENV)
    if not raw:
        return 0o700, 0o600
    dir_mode = int(raw, 8) & 0o770
    file_mode = (dir_mode & 0o660) | 0o600
    # Never group-writable files: the proxy refuses them.
    return dir_mode, file_mode & ~0o022


class StepCapture:
    """Selects flagged requests and publishes their last prompt hidden state, once per key."""

    def __init__(self, view: RunnerView, writer: Any | None, model_name: str) -> None:
        self.view = view
        self.writer = writer  # a RingWriter, or None on ranks that do not publish
        self.model_name = model_name
        self.selected = SelectedRequests()
        self._errors = _LogOnce()

    @classmethod
    def for_runner(cls, runner: Any, view: RunnerView) -> StepCapture:
        vllm_config = runner.vllm_config
        model_config = vllm_config.model_config
        served = getattr(model_config, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        model_name = str(served or model_config.model)
        if not _is_publishing_rank():
            return cls(view, None, model_name)
        view.check(runner)  # raises UnsupportedRunner before any ring file exists
        _check_parallelism(vllm_config)
        from ..ring import RingWriter

        dir_mode, file_mode = _ring_modes()
        slots = int(os.environ.get(RING_SLOTS_ENV) or DEFAULT_RING_SLOTS)
        hidden_size = int(model_config.get_hidden_size())
        writer = RingWriter.create(
            ring_dir_from_env(),
            writer_id=f"dp{_data_parallel_rank(vllm_config)}",
            hidden_size=hidden_size,
            model=model_name,
            slot_count=slots,
            dir_mode=dir_mode,
            file_mode=file_mode,
        )
        logger.info(
            "vllm-hidden-state-proxy: worker hook active (%s runner), publishing %d-d vectors "
            "to %s (%d slots)",
            view.name,
            hidden_size,
            writer.path,
            slots,
        )
        return cls(view, writer, model_name)

    @property
    def publishing(self) -> bool:
        return self.writer is not None

    def after_execute_model(self, runner: Any, scheduler_output: Any) -> None:
        """Called after every ``execute_model``; cheap unless a selected request is in the step."""
        if self.writer is None:
            return
        selected = self.selected
        try:
            selected.observe(scheduler_output.scheduled_new_reqs, scheduler_output.finished_req_ids)
        except Exception:
            self._errors.exception("reading the scheduler output")
            return
        if not selected.pending:
            return
        wanted = [rid for rid in selected.pending if rid in scheduler_output.num_scheduled_tokens]
        if not wanted:
            return
        try:
            self._publish_step(runner, scheduler_output, wanted)
        except Exception:
            self._errors.exception("publishing a step's hidden states")
            selected.drop(wanted)

    def _publish_step(self, runner: Any, scheduler_output: Any, wanted: list[str]) -> None:
        hidden_states = step_hidden_states(runner)
        if hidden_states is None:
            return
        rows: list[tuple[ScheduledRequest, int]] = []
        for request in self.view.scheduled(runner, scheduler_output, wanted):
            row = last_prompt_row(request)
            if row is not None:
                rows.append((request, row))
        if not rows:
            return
        vectors = _gather_rows_as_float32(hidden_states, [row for _, row in rows])
        assert self.writer is not None
        for (request, _), vector in zip(rows, vectors, strict=True):
            key = self.selected.pending.get(request.req_id)
            if key is None:  # a sibling published this key earlier in this loop
                continue
            self.writer.publish(
                key,
                vector,
                position=request.num_prompt_tokens - 1,
                num_prompt_tokens=request.num_prompt_tokens,
            )
            self.selected.mark_published(request.req_id, key)


def _gather_rows_as_float32(hidden_states: Any, rows: list[int]) -> list[bytes]:
    """One gather and one device-to-host copy for all rows; little-endian float32 bytes each."""
    import torch

    index = torch.tensor(rows, dtype=torch.long, device=hidden_states.device)
    selected = hidden_states.index_select(0, index).to(device="cpu", dtype=torch.float32)
    array = selected.contiguous().numpy().astype("<f4", copy=False)
    return [array[i].tobytes() for i in range(len(rows))]
