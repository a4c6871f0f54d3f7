"""Fakes shared by the worker hook tests: a V1-shaped runner, scheduler outputs, request keys.

Nothing here starts vLLM: scheduler outputs and V1's ``ExecuteModelState`` are vLLM's own
classes (where vLLM has no V1, 0.34 on, a stand-in of that state's two fields the hook reads),
the runner around them is a stand-in holding exactly the state the hook reads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_hidden_state_proxy.protocol import LAYERS_ENTRY, POOLING_ENTRY, REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import ErrorRecord, Found, Record
from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers

HIDDEN = 4
MODEL = "test-model"
#: The fake model's decoder layer count N: layer N is the final layer after the final norm.
FINAL = 4
#: What the fake server captures: two intermediate layers and the final one.
CAPTURED = CapturedLayers(FINAL, (0, 2, FINAL))

#: One step of a fake batch: (req_id, prompt length P, computed before nc, scheduled ns).
Batch = list[tuple[str, int, int, int]]
#: The values of one row: (req_id, row, prompt position, layer) -> ``HIDDEN`` floats.
Content = Callable[[str, int, int, int], Sequence[float]]


def key(n: int) -> bytes:
    return bytes([n] * 16)


def by_row(req_id: str, row: int, position: int, layer: int) -> list[float]:
    """Row ``row`` of layer ``layer``: ``(row + 0.25 * column) * 2 ** (layer - FINAL)``.

    Exact in float16 and bfloat16 for the small batches used here, and different for every
    (row, layer) pair, so a published vector names the row and the layer it was copied from.
    """
    scale = 2.0 ** (layer - FINAL)
    return [(row + 0.25 * column) * scale for column in range(HIDDEN)]


def row_vector(row: int, layer: int = FINAL) -> bytes:
    """Little-endian float32 bytes of :func:`by_row`'s row ``row`` of ``layer``."""
    return struct.pack(f"<{HIDDEN}f", *by_row("", row, 0, layer))


def by_position(req_id: str, row: int, position: int, layer: int) -> list[float]:
    """A pseudo-random row that depends on the request, the prompt position and the layer only
    (a recomputed position gets the same values, as with a real model)."""
    seed = zlib.crc32(f"{req_id}/{position}/{layer}".encode())
    values = np.random.default_rng(seed).uniform(-4.0, 4.0, HIDDEN)
    return [float(v) for v in values]


#: Whether the installed vLLM ships model runner V1 (vLLM 0.34 removed it on every platform).
HAS_V1 = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
V1_GONE = (
    f"vLLM {vllm.__version__} has no model runner V1 (0.34 removed "
    "vllm/v1/worker/gpu_model_runner.py, gpu_input_batch.py and cpu_model_runner.py)"
)
#: For tests of vLLM's own V1 classes.
needs_v1 = pytest.mark.skipif(not HAS_V1, reason=V1_GONE)


class V1ShapedState(NamedTuple):
    """Where V1 is gone, stands in for its ``ExecuteModelState`` (the two fields the hook
    reads), so that the fake V1 runner still exercises the capture's own logic against this
    vLLM's ``SchedulerOutput`` (see conftest's ``v1_shaped_state``)."""

    hidden_states: Any
    aux_hidden_states: Any


def v1_state_class() -> Any:
    """vLLM's own V1 ``ExecuteModelState``, or :class:`V1ShapedState` where V1 is gone."""
    if not HAS_V1:
        return V1ShapedState
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    return ExecuteModelState


def v1_execute_model_state(hidden_states: Any, aux_hidden_states: Any = None) -> Any:
    """vLLM's own V1 ``ExecuteModelState`` with the two fields the hook reads set."""
    ExecuteModelState = v1_state_class()
    fields: dict[str, Any] = dict.fromkeys(ExecuteModelState._fields)
    fields["hidden_states"] = hidden_states
    fields["aux_hidden_states"] = aux_hidden_states
    return ExecuteModelState(**fields)


class FakeModelConfig:
    """What the hook reads of vLLM's ``ModelConfig``."""

    def __init__(self, *, hidden_size: int = HIDDEN, num_hidden_layers: int = FINAL) -> None:
        self.served_model_name = [MODEL, "alias"]
        self.model = "org/model"
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_total_num_hidden_layers(self) -> int:
        return self.num_hidden_layers


def fake_vllm_config(parallel_config: Any = None, *, instance_id: str = "test-instance") -> Any:
    """A stand-in ``VllmConfig`` (one TP=PP=1 engine, index 0, unless told otherwise)."""
    if parallel_config is None:
        parallel_config = SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            rank=0,
            data_parallel_index=0,
            data_parallel_rank=0,
        )
    return SimpleNamespace(
        model_config=FakeModelConfig(), parallel_config=parallel_config, instance_id=instance_id
    )


class FakeV1Runner:
    """Exactly the state V1RunnerView, ``step_layers`` and the layer setup read, laid out per
    step as the V1 runner does."""

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        *,
        captured: CapturedLayers = CAPTURED,
        content: Content = by_row,
        vllm_config: Any = None,
        model: Any = None,
    ) -> None:
        self.dtype = dtype
        self.captured = captured
        self.content = content
        self.vllm_config = fake_vllm_config() if vllm_config is None else vllm_config
        self.model = model
        self.use_aux_hidden_state_outputs = False
        self.input_batch = SimpleNamespace(
            req_id_to_index={},
            num_computed_tokens_cpu=np.zeros(16, dtype=np.int32),
            num_prompt_tokens=np.zeros(16, dtype=np.int32),
        )
        self.query_start_loc = SimpleNamespace(np=np.zeros(17, dtype=np.int32))
        self.execute_model_state: Any = None

    def load(self, batch: Batch) -> dict[str, int]:
        """Lay out a step of (req_id, P, nc, ns) in batch order; return each request's start.

        Every captured layer gets a ``[tokens, HIDDEN]`` tensor of ``self.dtype`` whose rows
        come from ``self.content``: the final layer as ``hidden_states``, the others as
        ``aux_hidden_states`` in the order of ``captured.aux_ids`` (None without any).
        """
        b = self.input_batch
        b.req_id_to_index.clear()
        starts = {}
        placed: list[tuple[str, int, int]] = []  # (req_id, row, position)
        start = 0
        for i, (req_id, prompt_len, nc, ns) in enumerate(batch):
            b.req_id_to_index[req_id] = i
            b.num_prompt_tokens[i] = prompt_len
            b.num_computed_tokens_cpu[i] = nc
            self.query_start_loc.np[i] = start
            starts[req_id] = start
            placed.extend((req_id, start + j, nc + j) for j in range(ns))
            start += ns
        self.query_start_loc.np[len(batch) :] = start
        by_layer = {layer: self.layer_tensor(placed, layer) for layer in self.captured.layers}
        aux = [by_layer[layer] for layer in self.captured.aux_ids] or None
        self.execute_model_state = v1_execute_model_state(
            by_layer[self.captured.num_hidden_layers], aux
        )
        return starts

    def layer_tensor(self, placed: list[tuple[str, int, int]], layer: int) -> torch.Tensor:
        values = [list(self.content(req_id, row, pos, layer)) for req_id, row, pos in placed]
        tensor = torch.tensor(values, dtype=torch.float32).reshape(len(placed), HIDDEN)
        return tensor.to(self.dtype)

    def expected_mean(self, req_id: str, prompt_len: int, layer: int) -> np.ndarray[Any, Any]:
        """The float64 mean of the request's prompt rows of ``layer``, as held in ``dtype``."""
        rows = [list(self.content(req_id, -1, pos, layer)) for pos in range(prompt_len)]
        held = torch.tensor(rows, dtype=torch.float32).to(self.dtype).to(torch.float64)
        mean: np.ndarray[Any, Any] = held.mean(dim=0).numpy()
        return mean

    def get_model(self) -> Any:
        return self.model


def xargs(key: bytes, *, layers: Any = None, pooling: Any = None) -> dict[str, Any]:
    """A flagged request's ``SamplingParams.extra_args`` as the proxy sends them."""
    args: dict[str, Any] = {REQUEST_KEY_ENTRY: key.hex()}
    if layers is not None:
        args[LAYERS_ENTRY] = layers
    if pooling is not None:
        args[POOLING_ENTRY] = pooling
    return args


#: How a new request of :func:`sched` is flagged: a key (default layers and pooling), a raw
#: wire value for the key entry, a whole ``extra_args`` dict, or ``None`` (not flagged).
Flag = bytes | str | dict[str, Any] | None


def _extra_args(flag: Flag) -> dict[str, Any] | None:
    if flag is None or isinstance(flag, dict):
        return flag
    if isinstance(flag, bytes):
        return xargs(flag)
    return {REQUEST_KEY_ENTRY: flag}


def new_request_data(
    req_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams | None,
    *,
    num_computed_tokens: int = 0,
    prefill_token_ids: list[int] | None = None,
    block_ids: tuple[list[int], ...] = ([0],),
) -> NewRequestData:
    """vLLM's ``NewRequestData``; ``prefill_token_ids`` (what V2 prefills: the prompt, plus the
    output tokens of a resumed request) defaults to the prompt: vLLM 0.34 requires it."""
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=[],
        sampling_params=sampling_params,
        pooling_params=None,
        block_ids=block_ids,
        num_computed_tokens=num_computed_tokens,
        lora_request=None,
        prefill_token_ids=list(
            prompt_token_ids if prefill_token_ids is None else prefill_token_ids
        ),
    )


def cached_request_data(
    cached: Sequence[tuple[str, int]], resumed: Iterable[str] = ()
) -> CachedRequestData:
    """vLLM's ``CachedRequestData`` for (req_id, num_computed_tokens) pairs.

    ``resumed_req_ids`` and ``all_token_ids`` are set where this vLLM has them (0.34 dropped
    both: V2 resumes a preempted request as a new one); asking for resumed requests there is
    a test that needs V1.
    """
    fields = {field.name for field in dataclasses.fields(CachedRequestData)}
    kwargs: dict[str, Any] = {
        "req_ids": [rid for rid, _ in cached],
        "new_token_ids": [],
        "new_block_ids": [None] * len(cached),
        "num_computed_tokens": [nc for _, nc in cached],
        "num_output_tokens": [0] * len(cached),
    }
    resumed = set(resumed)
    if "resumed_req_ids" in fields:
        kwargs["resumed_req_ids"] = resumed
    elif resumed:
        raise AssertionError(f"vLLM {vllm.__version__} resumes preempted requests as new ones")
    if "all_token_ids" in fields:
        kwargs["all_token_ids"] = {}
    return CachedRequestData(**kwargs)


def sched(
    batch: Batch,
    *,
    new: dict[str, Flag] | None = None,
    finished: Iterable[str] = (),
) -> SchedulerOutput:
    """vLLM's ``SchedulerOutput`` for ``batch``; the requests in ``new`` are new this step."""
    new = new or {}
    new_reqs = []
    for req_id, prompt_len, nc, _ in batch:
        if req_id not in new:
            continue
        new_reqs.append(
            new_request_data(
                req_id,
                list(range(prompt_len)),
                SamplingParams(max_tokens=8, extra_args=_extra_args(new[req_id])),
                num_computed_tokens=nc,
            )
        )
    cached = [(rid, nc) for rid, _, nc, _ in batch if rid not in new]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_request_data(cached),
        num_scheduled_tokens={rid: ns for rid, _, _, ns in batch},
        total_num_scheduled_tokens=sum(ns for *_, ns in batch),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def step(capture: Any, runner: FakeV1Runner, batch: Batch, **kw: Any) -> dict[str, int]:
    """One ``execute_model``: lay out the batch, then run the capture's hook."""
    starts = runner.load(batch)
    capture.after_execute_model(runner, sched(batch, **kw))
    return starts


def record_of(found: Found | None) -> Record:
    assert isinstance(found, Record), f"expected a record, found {found!r}"
    return found


def error_of(found: Found | None) -> ErrorRecord:
    assert isinstance(found, ErrorRecord), f"expected an error record, found {found!r}"
    return found


def assert_last_record(
    found: Found | None,
    *,
    row: int,
    prompt_len: int,
    layers: Sequence[int] = (FINAL,),
) -> Record:
    """A "last" record whose vectors are row ``row`` of each of ``layers``, in that order."""
    record = record_of(found)
    assert record.layers == tuple(layers)
    assert record.pooling == "last"
    for layer in layers:
        assert record.vector(layer) == row_vector(row, layer), f"layer {layer}"
    assert record.vectors == b"".join(row_vector(row, layer) for layer in layers)
    assert record.position == prompt_len - 1
    assert record.num_prompt_tokens == prompt_len
    assert record.model == MODEL
    assert record.hidden_size == HIDDEN
    return record


class FakeRows:
    """A started copy (``device_copy.PendingRows``) that completes when the test calls
    ``complete()``, or when ``wait()`` runs and ``may_wait`` is set."""

    def __init__(self, vectors: list[bytes]) -> None:
        self._vectors = vectors
        self.completed = False
        self.failure: Exception | None = None
        self.released = False
        self.waits = 0
        self.waiting = threading.Event()  # set once wait() was entered
        self.may_wait = threading.Event()  # wait() blocks until this is set
        self.may_wait.set()

    def complete(self) -> None:
        self.completed = True

    def done(self) -> bool:
        if self.failure is not None:
            raise self.failure
        return self.completed

    def wait(self) -> None:
        self.waits += 1
        self.waiting.set()
        assert self.may_wait.wait(timeout=30), "wait() was never allowed to finish"
        if self.failure is not None:
            raise self.failure
        self.completed = True

    def buffer(self) -> memoryview:
        assert self.completed, "read before the copy completed"
        return memoryview(b"".join(self._vectors))

    def release(self) -> None:
        assert not self.released, "released twice"
        self.released = True
