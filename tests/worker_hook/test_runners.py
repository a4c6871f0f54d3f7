"""runners.py read against vLLM's own V1 and V2 runner state objects (CPU, no model).

The runners themselves need a model and a device; their *state objects* do not. Each harness
below builds the real state objects and updates them the way the runner's step does (the
method it mirrors is named on each step), so the views are checked against the layout vLLM
really produces, including its index bookkeeping (condense/swap in V1, reversed free-slot
allocation and batch sorting in V2).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

from tests.worker_hook.fakes import (
    HAS_V1,
    V1_GONE,
    cached_request_data,
    new_request_data,
    v1_execute_model_state,
)
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.worker_hook.runners import (
    UnsupportedRunner,
    V1RunnerView,
    V2RunnerView,
    step_layers,
)
from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest, last_prompt_row

CPU = torch.device("cpu")
KEY = "00112233445566778899aabbccddeeff"


def new_request(
    req_id: str,
    prompt_len: int,
    *,
    num_computed: int = 0,
    output_tokens: Iterable[int] = (),
) -> NewRequestData:
    prompt = [100 + i for i in range(prompt_len)]
    return new_request_data(
        req_id,
        prompt,
        SamplingParams(max_tokens=16, extra_args={REQUEST_KEY_ENTRY: KEY}),
        num_computed_tokens=num_computed,
        block_ids=([0, 1],),
        # V2: what the runner prefills (prompt + any output tokens of a resumed request).
        prefill_token_ids=prompt + list(output_tokens),
    )


def scheduler_output(
    *,
    new: Iterable[NewRequestData] = (),
    cached: Iterable[tuple[str, int]] = (),  # (req_id, num_computed_tokens)
    resumed: Iterable[str] = (),
    scheduled: dict[str, int],
    finished: Iterable[str] = (),
    preempted: Iterable[str] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_request_data(list(cached), resumed),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=None if preempted is None else set(preempted),
    )


# ---------------------------------------------------------------------------------------------
# V1: vllm.v1.worker.gpu_model_runner.GPUModelRunner
# ---------------------------------------------------------------------------------------------


class V1Harness:
    """A V1 runner's persistent batch, updated as ``GPUModelRunner`` does before the forward."""

    def __init__(self) -> None:
        from vllm.v1.utils import CpuGpuBuffer
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.max_num_reqs = 8
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=256,
            max_num_batched_tokens=256,
            device=CPU,
            vocab_size=1000,
            block_sizes=[16],
            max_num_blocks_per_req=[16],
        )
        # runner.query_start_loc = self._make_buffer(max_num_reqs + 1, dtype=torch.int32)
        self.query_start_loc = CpuGpuBuffer(
            self.max_num_reqs + 1, dtype=torch.int32, device=CPU, pin_memory=False
        )
        self.requests: dict[str, Any] = {}
        self.execute_model_state: Any = None
        self.vllm_config = object()

    def step(self, so: SchedulerOutput) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        batch = self.input_batch
        # _update_states: finished, then unscheduled (preempted) requests leave the batch.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        unscheduled = batch.req_id_to_index.keys() - (so.num_scheduled_tokens.keys() - resumed)
        for req_id in unscheduled:
            batch.remove_request(req_id)
        to_add = []
        for data in so.scheduled_new_reqs:
            state = CachedRequestState(  # as built in GPUModelRunner._update_states
                req_id=data.req_id,
                prompt_token_ids=data.prompt_token_ids,
                prompt_embeds=data.prompt_embeds,
                prompt_is_token_ids=data.prompt_is_token_ids,
                mm_features=data.mm_features,
                sampling_params=data.sampling_params,
                pooling_params=data.pooling_params,
                generator=None,
                block_ids=data.block_ids,
                num_computed_tokens=data.num_computed_tokens,
                output_token_ids=[],
                lora_request=data.lora_request,
            )
            self.requests[data.req_id] = state
            to_add.append(state)
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            index = batch.req_id_to_index.get(req_id)
            if index is None:  # resumed from preemption: re-added below
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = num_computed
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()  # also resets the batch's add/remove bookkeeping
        # _prepare_inputs: rows follow the persistent batch order.
        num_reqs = batch.num_reqs
        tokens = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        cu = np.cumsum(tokens)
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu
        self.query_start_loc.np[num_reqs + 1 :].fill(cu[-1])

    def row_of(self, req_id: str) -> int:
        return int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])


@pytest.fixture
def unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's host buffers without pinned memory, which needs a GPU driver to allocate.

    The CPU build of vLLM decides ``PIN_MEMORY`` is False by itself; the GPU build (vLLM 0.33's
    own wheel, ``make test-vllm-next``) decides True even where no driver is found, and its
    modules copied the flag at import. Only the allocation flag changes: the classes and their
    state are vLLM's own.
    """
    if HAS_V1:
        import vllm.v1.worker.gpu_input_batch  # noqa: F401  (its flag is the one to change)

    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "PIN_MEMORY", False) is True:
            monkeypatch.setattr(module, "PIN_MEMORY", False)


@pytest.fixture
def v1(unpinned: None) -> V1Harness:
    if not HAS_V1:
        pytest.skip(V1_GONE)
    return V1Harness()


def test_v1_mixed_batch(v1: V1Harness) -> None:
    view = V1RunnerView()
    # Step 1: five new requests.
    v1.step(
        scheduler_output(
            new=[
                new_request("chunked", 20),
                new_request("gone", 3),
                new_request("decoding", 4),
                new_request("hit", 12, num_computed=8),
                new_request("preempted", 5),
            ],
            scheduled={"chunked": 8, "gone": 3, "decoding": 4, "hit": 4, "preempted": 5},
        )
    )
    assert view.scheduled(v1, scheduler_output(scheduled={"hit": 4}), ["hit"]) == [
        ScheduledRequest("hit", v1.row_of("hit"), 8, 4, 12)
    ]
    # "preempted" produced 3 output tokens before it was preempted (left out of step 2).
    v1.requests["preempted"].output_token_ids.extend([7, 8, 9])

    # Step 2: "gone" finished (its slot is refilled by condense()), "preempted" is not
    # scheduled, "chunked" runs its middle chunk, "decoding" decodes, "full" is new.
    step2 = scheduler_output(
        new=[new_request("full", 6)],
        cached=[("chunked", 8), ("decoding", 4), ("hit", 12)],
        scheduled={"chunked": 8, "decoding": 1, "hit": 1, "full": 6},
        finished=["gone"],
    )
    v1.step(step2)
    assert "gone" not in v1.input_batch.req_id_to_index
    assert "preempted" not in v1.input_batch.req_id_to_index

    # Step 3: "preempted" resumes with all 5 + 3 tokens recomputed, "chunked" runs its last
    # chunk; an attention backend reorders the batch (GPUModelRunner._may_reorder_batch).
    step3 = scheduler_output(
        cached=[("chunked", 16), ("decoding", 5), ("hit", 13), ("full", 6), ("preempted", 0)],
        resumed=["preempted"],
        scheduled={"chunked": 4, "decoding": 1, "hit": 1, "full": 1, "preempted": 8},
    )
    v1.step(step3)
    batch = v1.input_batch
    batch.swap_states(0, batch.num_reqs - 1)
    tokens = [step3.num_scheduled_tokens[r] for r in batch.req_ids]
    v1.query_start_loc.np[1 : batch.num_reqs + 1] = np.cumsum(tokens)
    assert batch.req_ids[0] != "chunked"  # the batch order is not the insertion order

    wanted = ["preempted", "chunked", "decoding", "unknown", "full"]
    got = view.scheduled(v1, step3, wanted)
    # In `wanted` order; ids not in the batch are skipped.
    assert got == [
        ScheduledRequest("preempted", v1.row_of("preempted"), 0, 8, 5),
        ScheduledRequest("chunked", v1.row_of("chunked"), 16, 4, 20),
        ScheduledRequest("decoding", v1.row_of("decoding"), 5, 1, 4),
        ScheduledRequest("full", v1.row_of("full"), 6, 1, 6),
    ]
    assert all(type(v) is int for r in got for v in dataclasses.astuple(r)[1:])
    rows = {r.req_id: last_prompt_row(r) for r in got}
    assert rows == {
        "preempted": v1.row_of("preempted") + 4,  # P-1 = 4, recomputed from nc = 0
        "chunked": v1.row_of("chunked") + 3,  # P-1 = 19 = 16 + 3
        "decoding": None,
        "full": None,
    }
    # Every row lies in [0, total tokens) and rows of different requests differ.
    total = sum(step3.num_scheduled_tokens.values())
    preempted_row, chunked_row = rows["preempted"], rows["chunked"]
    assert preempted_row is not None and chunked_row is not None
    assert 0 <= preempted_row < total
    assert 0 <= chunked_row < total
    assert preempted_row != chunked_row


def test_v1_wanted_but_not_scheduled_is_skipped(v1: V1Harness) -> None:
    v1.step(
        scheduler_output(new=[new_request("a", 5), new_request("b", 7)], scheduled={"a": 5, "b": 7})
    )
    # "b" is in the persistent batch but this scheduler output did not schedule it.
    got = V1RunnerView().scheduled(v1, scheduler_output(scheduled={"a": 5}), ["b", "a"])
    assert got == [ScheduledRequest("a", 0, 0, 5, 5)]


def test_v1_view_check_accepts_the_real_v1_state(v1: V1Harness) -> None:
    V1RunnerView().check(v1)
    del v1.input_batch.__dict__["num_prompt_tokens"]  # a vLLM version that renamed it
    with pytest.raises(UnsupportedRunner, match="V1 input batch has no num_prompt_tokens"):
        V1RunnerView().check(v1)
    with pytest.raises(UnsupportedRunner, match="query_start_loc"):
        V1RunnerView().check(SimpleNamespace(input_batch=None, vllm_config=None))


def layer_states(tokens: int, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """One ``[tokens, 4]`` tensor per layer, filled with the layer's number."""
    return {layer: torch.full((tokens, 4), float(layer)) for layer in layers}


def test_v1_layers_come_from_execute_model_state(v1: V1Harness) -> None:
    # Between steps (after sample_tokens()) there is no state; the capture never asks then,
    # so being asked is an error (a request left waiting would time out at the proxy).
    for aux_ids in ((), (0, 2)):
        with pytest.raises(RuntimeError, match="kept no hidden states"):
            step_layers(v1, 4, aux_ids)
    states = layer_states(5, (0, 2, 4))
    v1.execute_model_state = v1_execute_model_state(states[4])
    assert step_layers(v1, 4, ()) == {4: states[4]}  # no auxiliary outputs asked for
    with pytest.raises(RuntimeError, match="returned 0 auxiliary hidden states, not the 2"):
        step_layers(v1, 4, (0, 2))
    # The V1 runner keeps the model's auxiliary outputs in the order of the aux layer ids.
    v1.execute_model_state = v1_execute_model_state(states[4], [states[0], states[2]])
    got = step_layers(v1, 4, (0, 2))
    assert got is not None
    assert list(got) == [4, 0, 2]
    assert all(got[layer] is states[layer] for layer in (0, 2, 4))
    with pytest.raises(RuntimeError, match="returned 2 auxiliary hidden states, not the 1"):
        step_layers(v1, 4, (2,))


# ---------------------------------------------------------------------------------------------
# V2: vllm.v1.worker.gpu.model_runner.GPUModelRunner
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_uva(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make vLLM's V2 ``RequestState`` constructible on this CPU-only machine.

    ``RequestState`` allocates ``UvaBackedTensor``/``StagedWriteTensor`` buffers whose
    ``UvaBuffer`` asks torch for pinned memory (``pin_memory=True``), which raises without an
    accelerator ("pin_memory=True requires a CUDA..."). ``is_uva_available()`` is already True
    on the CPU platform, so the only piece to swap is the ``UvaBuffer`` class that
    ``vllm.v1.worker.gpu.buffer_utils`` looks up at call time: replace it with vLLM's own CPU
    variant ``vllm.v1.worker.cpu.buffer_utils.UvaBuffer`` (plain CPU tensor, ``uva()`` returns
    a view of it). That is exactly what vLLM's CPU worker does globally in
    ``vllm/v1/worker/cpu/shm.py``; here monkeypatch undoes it after the test. Nothing below
    calls ``apply_staged_writes()`` (it runs a Triton kernel, unavailable on this CPU build).
    """
    import vllm.v1.worker.cpu.buffer_utils as cpu_buffer_utils
    import vllm.v1.worker.gpu.buffer_utils as gpu_buffer_utils

    monkeypatch.setattr(gpu_buffer_utils, "UvaBuffer", cpu_buffer_utils.UvaBuffer)


class V2Harness:
    """A V2 runner's ``req_states`` and per-step ``InputBatch``, built as its step does."""

    def __init__(self) -> None:
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.states import RequestState

        self.max_num_reqs = 8
        self.req_states = RequestState(
            max_num_reqs=self.max_num_reqs,
            max_model_len=256,
            max_num_batched_tokens=256,
            num_speculative_steps=0,
            vocab_size=1000,
            device=CPU,
        )
        self.input_buffers = InputBuffers(self.max_num_reqs, 256, CPU)
        self.execute_model_state: Any = None
        self.vllm_config = object()

    def step(
        self,
        so: SchedulerOutput,
        *,
        pad_reqs: int = 0,
        aux_ids: Sequence[int] = (),
        last_stage: bool = True,
    ) -> None:
        """One step; ``aux_ids``: the model returns those auxiliary layers too (filled with
        their number, the final hidden states with -1); ``last_stage=False``: a non-last
        pipeline stage, which keeps no hidden states (``execute_model``)."""
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import ExecuteModelState, sort_batch_req_ids

        states = self.req_states
        # finish_requests: finished and preempted requests leave the persistent state.
        for req_id in sorted(so.finished_req_ids | (so.preempted_req_ids or set())):
            states.remove_request(req_id)
        # add_requests: new (and resumed-after-preemption) requests, via vLLM's add_request.
        for data in so.scheduled_new_reqs:
            states.remove_request(data.req_id)
            states.add_request(
                req_id=data.req_id,
                prompt_len=data.prompt_len,
                all_token_ids=data.prefill_token_ids,
                num_computed_tokens=data.num_computed_tokens,
                max_tokens=data.sampling_params.max_tokens,
            )
        # update_requests
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            states.num_computed_tokens_np[states.req_id_to_index[req_id]] = num_computed
        # gather_batch_req_state + prepare_inputs
        req_ids = sort_batch_req_ids(so.num_scheduled_tokens, {}, 1)
        num_reqs = len(req_ids)
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        idx_mapping_np = np.array([states.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        num_tokens = int(num_scheduled.sum())
        padded = num_reqs + pad_reqs
        query_start_loc_np = np.empty(self.max_num_reqs + 1, dtype=np.int32)
        query_start_loc_np[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc_np[1 : num_reqs + 1])
        query_start_loc_np[num_reqs + 1 :] = num_tokens
        # Fields the view does not read keep make_dummy()'s placeholders.
        placeholder = InputBatch.make_dummy(num_reqs, num_tokens, self.input_buffers)
        batch = dataclasses.replace(
            placeholder,
            req_ids=req_ids,
            num_reqs=num_reqs,
            num_reqs_after_padding=padded,
            idx_mapping=torch.from_numpy(idx_mapping_np.astype(np.int64)),
            idx_mapping_np=idx_mapping_np,
            num_scheduled_tokens=num_scheduled,
            num_tokens=num_tokens,
            num_tokens_after_padding=num_tokens,
            query_start_loc_np=query_start_loc_np[: padded + 1],
            num_computed_tokens_np=states.num_computed_tokens_np[idx_mapping_np],
            prefill_len_np=states.prefill_len.np[idx_mapping_np],
        )
        self.execute_model_state = ExecuteModelState(
            input_batch=batch,
            attn_metadata=None,
            slot_mappings_by_layer=None,
            hidden_states=torch.full((num_tokens, 4), -1.0) if last_stage else None,
            aux_hidden_states=(
                [torch.full((num_tokens, 4), float(a)) for a in aux_ids]
                if aux_ids and last_stage
                else None
            ),
            dp_sync_state=None,
            finished_req_ids=so.finished_req_ids,
            ec_connector_output=None,
            cudagraph_stats=None,
            num_spec_tokens_to_schedule=0,
        )

    def row_of(self, req_id: str) -> int:
        batch = self.execute_model_state.input_batch
        return int(batch.query_start_loc_np[batch.req_ids.index(req_id)])


@pytest.fixture
def v2(cpu_uva: None, unpinned: None) -> V2Harness:
    return V2Harness()


def test_v2_request_state_is_vllms_own(v2: V2Harness) -> None:
    v2.req_states.add_request(
        "r", prompt_len=5, all_token_ids=list(range(8)), num_computed_tokens=0, max_tokens=4
    )
    index = v2.req_states.req_id_to_index["r"]
    assert index == v2.max_num_reqs - 1  # free slots are handed out from the end
    assert v2.req_states.prompt_len.np[index] == 5
    assert v2.req_states.prefill_len.np[index] == 8


def test_v2_mixed_batch_with_resumed_request(v2: V2Harness) -> None:
    view = V2RunnerView()
    v2.step(
        scheduler_output(
            new=[
                new_request("chunked", 20),
                new_request("decoding", 4),
                new_request("victim", 6),
                new_request("hit", 12, num_computed=8),
            ],
            scheduled={"chunked": 8, "decoding": 4, "victim": 6, "hit": 4},
        )
    )
    first = view.scheduled(v2, None, ["hit", "victim"])
    # Batch order (V2 sorts by tokens scheduled), not `wanted` order.
    assert [r.req_id for r in first] == ["hit", "victim"]
    assert first == [
        ScheduledRequest("hit", v2.row_of("hit"), 8, 4, 12),
        ScheduledRequest("victim", v2.row_of("victim"), 0, 6, 6),
    ]

    # Step 2: "victim" is preempted after producing 2 tokens (it leaves req_states).
    v2.step(
        scheduler_output(
            cached=[("chunked", 8), ("decoding", 4), ("hit", 12)],
            scheduled={"chunked": 8, "decoding": 1, "hit": 1},
            preempted=["victim"],
        )
    )
    assert "victim" not in v2.req_states.req_id_to_index
    assert view.scheduled(v2, None, ["victim"]) == []

    # Step 3: "victim" comes back as a new request carrying prompt + outputs, with a prefix
    # cache hit of 4 tokens; "chunked" runs its last chunk; the batch is padded.
    v2.step(
        scheduler_output(
            new=[new_request("victim", 6, num_computed=4, output_tokens=[7, 8])],
            cached=[("chunked", 16), ("decoding", 5), ("hit", 13)],
            scheduled={"chunked": 4, "decoding": 1, "hit": 1, "victim": 4},
        ),
        pad_reqs=2,
    )
    batch = v2.execute_model_state.input_batch
    assert batch.num_reqs_after_padding > batch.num_reqs
    victim_index = v2.req_states.req_id_to_index["victim"]
    assert (
        v2.req_states.prefill_len.np[victim_index] == 8 > v2.req_states.prompt_len.np[victim_index]
    )

    got = view.scheduled(v2, None, {"victim", "chunked", "decoding", "absent"})
    by_id = {r.req_id: r for r in got}
    assert by_id == {
        "victim": ScheduledRequest("victim", v2.row_of("victim"), 4, 4, 6),
        "chunked": ScheduledRequest("chunked", v2.row_of("chunked"), 16, 4, 20),
        "decoding": ScheduledRequest("decoding", v2.row_of("decoding"), 5, 1, 4),
    }
    assert [r.req_id for r in got] == [r for r in batch.req_ids if r in by_id]
    assert all(type(v) is int for r in got for v in dataclasses.astuple(r)[1:])
    assert last_prompt_row(by_id["victim"]) == v2.row_of("victim") + 1  # P-1 = 5 = 4 + 1
    assert last_prompt_row(by_id["chunked"]) == v2.row_of("chunked") + 3
    assert last_prompt_row(by_id["decoding"]) is None


def test_v2_layers_and_no_state(v2: V2Harness) -> None:
    view = V2RunnerView()
    with pytest.raises(RuntimeError, match="kept no hidden states"):
        step_layers(v2, 4, ())
    assert view.scheduled(v2, None, ["a"]) == []
    v2.step(scheduler_output(new=[new_request("a", 3)], scheduled={"a": 3}))
    assert step_layers(v2, 4, ()) == {4: v2.execute_model_state.hidden_states}
    assert view.scheduled(v2, None, ["a"]) == [ScheduledRequest("a", 0, 0, 3, 3)]


def test_v2_auxiliary_layers(v2: V2Harness) -> None:
    v2.step(
        scheduler_output(
            new=[new_request("a", 3), new_request("b", 2)], scheduled={"a": 3, "b": 2}
        ),
        aux_ids=(0, 2),
    )
    got = step_layers(v2, 4, (0, 2))
    assert got is not None
    assert sorted(got) == [0, 2, 4]
    for layer, value in ((0, 0.0), (2, 2.0), (4, -1.0)):
        assert got[layer].shape == (5, 4)
        assert bool((got[layer] == value).all()), layer
    with pytest.raises(RuntimeError, match="returned 2 auxiliary hidden states, not the 3"):
        step_layers(v2, 4, (0, 1, 2))


def test_v2_non_last_pipeline_stage_has_no_layers(v2: V2Harness) -> None:
    v2.step(scheduler_output(new=[new_request("a", 3)], scheduled={"a": 3}), last_stage=False)
    assert v2.execute_model_state is not None  # V2 keeps the state, without hidden states
    # Such a rank does not publish (engine.is_publishing_rank); were it asked, it would say so.
    for aux_ids in ((), (0, 2)):
        with pytest.raises(RuntimeError, match="kept no hidden states"):
            step_layers(v2, 4, aux_ids)


def test_v2_view_check_accepts_vllms_real_v2_classes(v2: V2Harness) -> None:
    V2RunnerView().check(v2)
    with pytest.raises(UnsupportedRunner, match="prompt_len"):
        V2RunnerView().check(
            SimpleNamespace(vllm_config=object(), req_states=object(), execute_model_state=None)
        )
    with pytest.raises(UnsupportedRunner, match="req_states"):
        V2RunnerView().check(SimpleNamespace(vllm_config=object(), execute_model_state=None))
    with pytest.raises(UnsupportedRunner, match="V2 model runner has no execute_model_state"):
        V2RunnerView().check(SimpleNamespace(vllm_config=object(), req_states=v2.req_states))
    prompt_len = v2.req_states.prompt_len
    v2.req_states.prompt_len = SimpleNamespace(np=[3, 4])  # a list where vLLM had an array
    try:
        with pytest.raises(UnsupportedRunner, match=r"prompt_len\.np is a list, not an array"):
            V2RunnerView().check(v2)
    finally:
        v2.req_states.prompt_len = prompt_len


def test_where_v1_is_gone_its_view_says_so_and_v2_does_not_care(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34 has no ``gpu_model_runner`` module: the hook's own lookup of V1's state class
    (not conftest's stand-in) turns that into a refusal of V1 runners, not an ImportError, and
    V2's checks never look there."""
    from tests.worker_hook.conftest import REAL_V1_STATE_CLASS
    from vllm_hidden_state_proxy.worker_hook import runners

    monkeypatch.setattr(runners, "_v1_state_class", REAL_V1_STATE_CLASS)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)  # as if removed
    assert V1RunnerView().class_problems() == [
        "this vLLM has no V1 model runner (vllm.v1.worker.gpu_model_runner)"
    ]
    assert V2RunnerView().class_problems() == []
