"""capture.StepCapture end to end, without a server: fake runner state -> real ring -> reader."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from tests.worker_hook.conftest import HIDDEN, MODEL
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import RingDirectory, RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook import capture as capture_mod
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import SyncRowCopier
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView


def key(n: int) -> bytes:
    return bytes([n] * 16)


def expected_vector(row: int) -> bytes:
    """Little-endian float32 of the fake hidden state row ``row``."""
    return struct.pack(f"<{HIDDEN}f", *(row + 0.25 * c for c in range(HIDDEN)))


class FakeV1Runner:
    """Exactly the state V1RunnerView reads, laid out per step as the V1 runner does."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.input_batch = SimpleNamespace(
            req_id_to_index={},
            num_computed_tokens_cpu=np.zeros(8, dtype=np.int32),
            num_prompt_tokens=np.zeros(8, dtype=np.int32),
        )
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, dtype=np.int32))
        self.execute_model_state: Any = None

    def load(self, batch: list[tuple[str, int, int, int]]) -> dict[str, int]:
        """Lay out a step of (req_id, P, nc, ns) in batch order; return each request's start.

        Row ``r`` of the step's hidden states holds ``r + 0.25 * column`` (exact in fp16 and
        bf16), so a published vector names the row it was copied from.
        """
        b = self.input_batch
        b.req_id_to_index.clear()
        starts = {}
        start = 0
        for i, (req_id, prompt_len, nc, ns) in enumerate(batch):
            b.req_id_to_index[req_id] = i
            b.num_prompt_tokens[i] = prompt_len
            b.num_computed_tokens_cpu[i] = nc
            self.query_start_loc.np[i] = start
            starts[req_id] = start
            start += ns
        self.query_start_loc.np[len(batch) :] = start
        rows = torch.arange(start, dtype=torch.float32)[:, None]
        cols = 0.25 * torch.arange(HIDDEN, dtype=torch.float32)[None, :]
        self.execute_model_state = SimpleNamespace(hidden_states=(rows + cols).to(self.dtype))
        return starts


def v1_capture(writer: RingWriter) -> tuple[FakeV1Runner, StepCapture]:
    """A float16 fake V1 runner and a publishing capture reading it."""
    return FakeV1Runner(torch.float16), StepCapture(V1RunnerView(), writer, MODEL)


def sched(
    batch: list[tuple[str, int, int, int]],
    *,
    new: dict[str, bytes | str | None] | None = None,  # req_id -> key (None: not flagged)
    finished: Iterable[str] = (),
) -> SchedulerOutput:
    new = new or {}
    new_reqs = []
    for req_id, prompt_len, nc, _ in batch:
        if req_id not in new:
            continue
        k = new[req_id]
        extra = None if k is None else {REQUEST_KEY_ENTRY: k.hex() if isinstance(k, bytes) else k}
        new_reqs.append(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=list(range(prompt_len)),
                mm_features=[],
                sampling_params=SamplingParams(max_tokens=8, extra_args=extra),
                pooling_params=None,
                block_ids=([0],),
                num_computed_tokens=nc,
                lora_request=None,
            )
        )
    cached = [(rid, nc) for rid, _, nc, _ in batch if rid not in new]
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[rid for rid, _ in cached],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * len(cached),
            num_computed_tokens=[nc for _, nc in cached],
            num_output_tokens=[0] * len(cached),
        ),
        num_scheduled_tokens={rid: ns for rid, _, _, ns in batch},
        total_num_scheduled_tokens=sum(ns for *_, ns in batch),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def run(
    capture: StepCapture,
    runner: FakeV1Runner,
    batch: list[tuple[str, int, int, int]],
    **kw: Any,
) -> dict[str, int]:
    starts = runner.load(batch)
    capture.after_execute_model(runner, sched(batch, **kw))
    return starts


def assert_record(reader: RingReader, k: bytes, *, row: int, prompt_len: int) -> None:
    record = reader.lookup(k)
    assert record is not None
    assert record.vector == expected_vector(row)
    assert record.position == prompt_len - 1
    assert record.num_prompt_tokens == prompt_len
    assert record.model == MODEL
    assert record.hidden_size == HIDDEN


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_publishes_exactly_the_flagged_last_prompt_rows(
    dtype: torch.dtype, writer: RingWriter, reader: RingReader, ring_dir: Path
) -> None:
    runner = FakeV1Runner(dtype)
    capture = StepCapture(V1RunnerView(), writer, MODEL)
    batch = [
        ("plain", 3, 0, 3),  # not flagged
        ("a", 5, 0, 5),  # flagged, full prefill: row 3 + 4
        ("chunk", 30, 0, 8),  # flagged, first chunk only: nothing yet
        ("hit", 6, 4, 2),  # flagged, prefix-cache hit of 4: row 16 + 1
    ]
    starts = run(
        capture, runner, batch, new={"plain": None, "a": key(1), "chunk": key(2), "hit": key(3)}
    )
    assert starts == {"plain": 0, "a": 3, "chunk": 8, "hit": 16}
    assert writer.publish_count == 2
    assert_record(reader, key(1), row=3 + 4, prompt_len=5)
    assert_record(reader, key(3), row=16 + 1, prompt_len=6)
    assert reader.lookup(key(2)) is None
    assert capture.selected.pending == {"chunk": key(2)}
    # The proxy's view of the directory finds the same record.
    with RingDirectory(ring_dir) as directory:
        record = directory.lookup(key(1))
        assert record is not None
        assert record.as_floats() == [7.0, 7.25, 7.5, 7.75]

    # Decode steps of the published requests publish nothing more.
    run(capture, runner, [("a", 5, 5, 1), ("hit", 6, 6, 1), ("chunk", 30, 8, 8)])
    assert writer.publish_count == 2


def test_chunked_prefill_publishes_once_at_the_step_holding_p_minus_1(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    k = key(9)
    # P = 10 in chunks of 4, 4, 2, next to other requests whose rows shift it around.
    run(capture, runner, [("c", 10, 0, 4), ("x", 3, 0, 3)], new={"c": k, "x": None})
    assert writer.publish_count == 0
    assert reader.lookup(k) is None
    run(capture, runner, [("x", 3, 3, 1), ("c", 10, 4, 4)])
    assert writer.publish_count == 0
    assert reader.lookup(k) is None
    starts = run(
        capture, runner, [("y", 2, 0, 2), ("x", 3, 4, 1), ("c", 10, 8, 2)], new={"y": None}
    )
    assert starts["c"] == 3
    assert writer.publish_count == 1
    assert_record(reader, k, row=3 + 1, prompt_len=10)
    assert capture.selected.pending == {}
    run(capture, runner, [("c", 10, 10, 1)])
    assert writer.publish_count == 1


def test_n_siblings_publish_one_record(writer: RingWriter, reader: RingReader) -> None:
    runner, capture = v1_capture(writer)
    k = key(4)
    run(capture, runner, [("0_p", 4, 0, 4), ("1_p", 4, 0, 4)], new={"0_p": k, "1_p": k})
    assert writer.publish_count == 1
    assert_record(reader, k, row=3, prompt_len=4)
    # A third child scheduled later (prefix-cache hit) does not publish the key again.
    run(capture, runner, [("2_p", 4, 3, 1)], new={"2_p": k})
    assert writer.publish_count == 1


def test_re_prefill_after_preemption(writer: RingWriter, reader: RingReader) -> None:
    runner, capture = v1_capture(writer)
    # "early" is preempted mid-prefill, "late" after its vector was published.
    run(
        capture,
        runner,
        [("early", 12, 0, 8), ("late", 4, 0, 4)],
        new={"early": key(5), "late": key(6)},
    )
    assert writer.publish_count == 1
    run(capture, runner, [("late", 4, 4, 1)])  # "early" preempted (not scheduled)
    run(capture, runner, [("late", 4, 5, 1)])  # "late" preempted after 2 outputs
    # Both re-prefilled from scratch, prompt + output tokens.
    run(capture, runner, [("late", 4, 0, 6), ("early", 12, 0, 12)])
    assert writer.publish_count == 2
    assert_record(reader, key(6), row=8 + 3, prompt_len=4)  # the first publication stands
    assert_record(reader, key(5), row=6 + 11, prompt_len=12)


def test_finished_before_its_last_chunk_publishes_nothing(writer: RingWriter) -> None:
    runner, capture = v1_capture(writer)
    run(capture, runner, [("c", 10, 0, 4)], new={"c": key(7)})
    run(capture, runner, [("z", 2, 0, 2)], new={"z": None}, finished=["c"])
    assert capture.selected.pending == {}
    assert writer.publish_count == 0


def test_step_without_hidden_states_keeps_the_request_pending(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    batch = [("a", 3, 0, 3)]
    runner.load(batch)
    runner.execute_model_state = None  # e.g. a non-last PP rank or an empty step
    capture.after_execute_model(runner, sched(batch, new={"a": key(8)}))
    assert writer.publish_count == 0
    assert capture.selected.pending == {"a": key(8)}
    run(capture, runner, batch)
    assert_record(reader, key(8), row=2, prompt_len=3)


class RaisingView(V1RunnerView):
    def scheduled(self, runner: Any, scheduler_output: Any, wanted: Any) -> Any:
        raise RuntimeError("runner internals changed")


def test_view_failure_is_contained_logged_once_and_drops_the_keys(
    writer: RingWriter, reader: RingReader, hook_log: Any
) -> None:
    runner = FakeV1Runner(torch.float16)
    capture = StepCapture(RaisingView(), writer, MODEL)
    run(capture, runner, [("a", 3, 0, 3), ("b", 2, 0, 2)], new={"a": key(1), "b": key(2)})
    assert capture.selected.pending == {}
    errors = [r for r in hook_log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert "publishing" in errors[0].getMessage()
    # Next failing step: still contained, not logged again.
    run(capture, runner, [("c", 4, 0, 4)], new={"c": key(3)})
    assert capture.selected.pending == {}
    assert len([r for r in hook_log.records if r.levelno >= logging.ERROR]) == 1
    assert writer.publish_count == 0
    # The dropped requests are not published later by a working view either.
    capture.view = V1RunnerView()
    run(capture, runner, [("a", 3, 0, 3)])
    assert writer.publish_count == 0
    assert reader.lookup(key(1)) is None


def test_unreadable_scheduler_output_is_contained(writer: RingWriter, hook_log: Any) -> None:
    class Broken:
        def __init__(self) -> None:
            self.finished_req_ids: set[str] = set()
            self.num_scheduled_tokens: dict[str, int] = {}

        @property
        def scheduled_new_reqs(self) -> list[Any]:
            raise AttributeError("renamed in a later vLLM")

    capture = StepCapture(V1RunnerView(), writer, MODEL)
    capture.after_execute_model(FakeV1Runner(torch.float16), Broken())
    capture.after_execute_model(FakeV1Runner(torch.float16), Broken())
    errors = [r for r in hook_log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "scheduler output" in errors[0].getMessage()


def test_a_malformed_key_does_not_cost_other_requests_their_vector(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    batch = [("bad", 3, 0, 3), ("good", 3, 0, 3)]
    run(capture, runner, batch, new={"bad": "ab" * 15 + "  ", "good": key(1)})
    assert reader.lookup(key(1)) is not None


class UntouchableView(V1RunnerView):
    def hidden_states(self, runner: Any) -> Any:
        raise AssertionError("a non-publishing rank must not read the runner")

    def scheduled(self, runner: Any, scheduler_output: Any, wanted: Any) -> Any:
        raise AssertionError("a non-publishing rank must not read the runner")


def test_non_publishing_rank_does_nothing(hook_log: Any) -> None:
    capture = StepCapture(UntouchableView(), None, MODEL)
    assert not capture.publishing
    runner = FakeV1Runner(torch.float16)
    batch = [("a", 3, 0, 3)]
    run(capture, runner, batch, new={"a": key(1)})
    assert capture.selected.pending == {}  # not even tracked
    # Neither runner nor scheduler output is touched at all.
    capture.after_execute_model(object(), object())
    assert hook_log.records == []


def test_cpu_copy_is_little_endian_and_ordered() -> None:
    hidden = (torch.arange(12, dtype=torch.float32).reshape(6, 2) / 4).to(torch.bfloat16)
    pending = SyncRowCopier().start(hidden, [5, 0, 5])
    assert pending.done()
    out = pending.vectors()
    assert out == [
        struct.pack("<2f", 2.5, 2.75),
        struct.pack("<2f", 0.0, 0.25),
        struct.pack("<2f", 2.5, 2.75),
    ]


@pytest.mark.parametrize(
    ("raw", "modes"),
    [
        (None, (0o700, 0o600)),
        ("", (0o700, 0o600)),
        ("0750", (0o750, 0o640)),
        ("0770", (0o770, 0o640)),  # files are never group-writable: the proxy refuses those
        ("0777", (0o770, 0o640)),  # nothing for others
    ],
)
def test_ring_modes(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, modes: tuple[int, int]
) -> None:
    if raw is None:
        monkeypatch.delenv(capture_mod.RING_DIR_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(capture_mod.RING_DIR_MODE_ENV, raw)
    assert capture_mod._ring_modes() == modes
