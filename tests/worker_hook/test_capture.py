"""capture.StepCapture end to end, without a server: fake runner state -> real ring -> reader.

Steps are laid out by :class:`~tests.worker_hook.fakes.FakeV1Runner` (row ``r`` of layer ``L``
names ``r`` and ``L``, or rows that depend on the prompt position for mean pooling) and read
through the real ``V1RunnerView``; records land in a real ring and are read back by a real
reader. The capture uses the synchronous CPU copier here; the asynchronous device path is in
``test_device_copy.py``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vllm

from tests.ring.helpers import directory_lock_held
from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import (
    CAPTURED,
    FINAL,
    HIDDEN,
    MODEL,
    Content,
    FakeV1Runner,
    assert_last_record,
    by_position,
    by_row,
    error_of,
    fake_vllm_config,
    key,
    record_of,
    sched,
    step,
    xargs,
)
from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    RING_LOCK_TIMEOUT_ENV,
    RING_SLOTS_ENV,
)
from vllm_hidden_state_proxy.ring import (
    FailureNote,
    RingDirectory,
    RingDirectoryConflict,
    RingInUseError,
    RingReader,
    RingWriter,
)
from vllm_hidden_state_proxy.ring.files import (
    DirectoryLocked,
    UntrustedDirectory,
    note_name,
    ring_name,
)
from vllm_hidden_state_proxy.ring.notes import read_live_note
from vllm_hidden_state_proxy.worker_hook import ring_start
from vllm_hidden_state_proxy.worker_hook.capture import STEP_FAILED, StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import PendingRows, SyncRowCopier
from vllm_hidden_state_proxy.worker_hook.engine import instance_of
from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers, LayerConfigError
from vllm_hidden_state_proxy.worker_hook.runners import (
    RefusedSettings,
    UnsupportedRunner,
    V1RunnerView,
)


def v1_capture(
    writer: RingWriter,
    *,
    dtype: torch.dtype = torch.float16,
    content: Content = by_row,
    view: V1RunnerView | None = None,
    copier: Any = None,
) -> tuple[FakeV1Runner, StepCapture]:
    """A fake V1 runner and a publishing capture of the ``CAPTURED`` layers reading it."""
    runner = FakeV1Runner(dtype, content=content)
    capture = StepCapture(view or V1RunnerView(), writer, MODEL, captured=CAPTURED, copier=copier)
    return runner, capture


def pending_keys(capture: StepCapture) -> dict[str, bytes]:
    return {req_id: s.key for req_id, s in capture.selected.pending.items()}


def error_logs(hook_log: HookLog) -> list[logging.LogRecord]:
    return [r for r in hook_log.records if r.levelno >= logging.ERROR]


# -- "last" pooling: which row, when, once --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_publishes_exactly_the_flagged_last_prompt_rows(
    dtype: torch.dtype, writer: RingWriter, reader: RingReader, ring_dir: Path
) -> None:
    runner, capture = v1_capture(writer, dtype=dtype)
    batch = [
        ("plain", 3, 0, 3),  # not flagged
        ("a", 5, 0, 5),  # flagged, full prefill: row 3 + 4
        ("chunk", 30, 0, 8),  # flagged, first chunk only: nothing yet
        ("hit", 6, 4, 2),  # flagged, prefix-cache hit of 4: row 16 + 1
    ]
    starts = step(
        capture, runner, batch, new={"plain": None, "a": key(1), "chunk": key(2), "hit": key(3)}
    )
    assert starts == {"plain": 0, "a": 3, "chunk": 8, "hit": 16}
    assert writer.publish_count() == 2
    assert_last_record(reader.lookup(key(1)), row=3 + 4, prompt_len=5)
    assert_last_record(reader.lookup(key(3)), row=16 + 1, prompt_len=6)
    assert reader.lookup(key(2)) is None
    assert pending_keys(capture) == {"chunk": key(2)}
    # The proxy's view of the directory finds the same record.
    with RingDirectory(ring_dir) as directory:
        assert record_of(directory.lookup(key(1))).floats(FINAL) == [7.0, 7.25, 7.5, 7.75]

    # Decode steps of the published requests publish nothing more.
    step(capture, runner, [("a", 5, 5, 1), ("hit", 6, 6, 1), ("chunk", 30, 8, 8)])
    assert writer.publish_count() == 2


def test_chunked_prefill_publishes_once_at_the_step_holding_p_minus_1(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    k = key(9)
    # P = 10 in chunks of 4, 4, 2, next to other requests whose rows shift it around.
    step(capture, runner, [("c", 10, 0, 4), ("x", 3, 0, 3)], new={"c": k, "x": None})
    assert writer.publish_count() == 0
    assert reader.lookup(k) is None
    step(capture, runner, [("x", 3, 3, 1), ("c", 10, 4, 4)])
    assert writer.publish_count() == 0
    assert reader.lookup(k) is None
    starts = step(
        capture, runner, [("y", 2, 0, 2), ("x", 3, 4, 1), ("c", 10, 8, 2)], new={"y": None}
    )
    assert starts["c"] == 3
    assert writer.publish_count() == 1
    assert_last_record(reader.lookup(k), row=3 + 1, prompt_len=10)
    assert capture.selected.pending == {}
    step(capture, runner, [("c", 10, 10, 1)])
    assert writer.publish_count() == 1


def test_n_siblings_publish_one_record(writer: RingWriter, reader: RingReader) -> None:
    runner, capture = v1_capture(writer)
    k = key(4)
    step(capture, runner, [("0_p", 4, 0, 4), ("1_p", 4, 0, 4)], new={"0_p": k, "1_p": k})
    assert writer.publish_count() == 1
    assert_last_record(reader.lookup(k), row=3, prompt_len=4)
    # A third child scheduled later (prefix-cache hit) does not publish the key again.
    step(capture, runner, [("2_p", 4, 3, 1)], new={"2_p": k})
    assert writer.publish_count() == 1


def test_re_prefill_after_preemption(writer: RingWriter, reader: RingReader) -> None:
    runner, capture = v1_capture(writer)
    # "early" is preempted mid-prefill, "late" after its vector was published.
    step(
        capture,
        runner,
        [("early", 12, 0, 8), ("late", 4, 0, 4)],
        new={"early": key(5), "late": key(6)},
    )
    assert writer.publish_count() == 1
    step(capture, runner, [("late", 4, 4, 1)])  # "early" preempted (not scheduled)
    step(capture, runner, [("late", 4, 5, 1)])  # "late" preempted after 2 outputs
    # Both re-prefilled from scratch, prompt + output tokens.
    step(capture, runner, [("late", 4, 0, 6), ("early", 12, 0, 12)])
    assert writer.publish_count() == 2
    assert_last_record(reader.lookup(key(6)), row=8 + 3, prompt_len=4)  # the first one stands
    assert_last_record(reader.lookup(key(5)), row=6 + 11, prompt_len=12)


def test_finished_before_its_last_chunk_publishes_nothing(writer: RingWriter) -> None:
    runner, capture = v1_capture(writer)
    step(capture, runner, [("c", 10, 0, 4)], new={"c": key(7)})
    step(capture, runner, [("z", 2, 0, 2)], new={"z": None}, finished=["c"])
    assert capture.selected.pending == {}
    assert writer.publish_count() == 0


def test_a_step_without_hidden_states_answers_its_requests_with_an_error(
    writer: RingWriter, reader: RingReader
) -> None:
    """A step that computed a flagged prompt but kept no state (a vLLM whose runner stopped
    keeping it) is an error record at once, not a request left to time out at the proxy."""
    runner, capture = v1_capture(writer)
    batch = [("a", 3, 0, 3)]
    runner.load(batch)
    runner.execute_model_state = None
    capture.after_execute_model(runner, sched(batch, new={"a": key(8)}))
    assert error_of(reader.lookup(key(8))).message == STEP_FAILED
    assert pending_keys(capture) == {}


def test_a_malformed_key_does_not_cost_other_requests_their_vector(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    batch = [("bad", 3, 0, 3), ("good", 3, 0, 3)]
    step(capture, runner, batch, new={"bad": "ab" * 15 + "  ", "good": key(1)})
    assert_last_record(reader.lookup(key(1)), row=5, prompt_len=3)
    assert writer.publish_count() == 1


# -- "last" pooling with several layers -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_last_rows_of_each_wanted_layer_in_layer_order(
    dtype: torch.dtype, writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=dtype)
    batch = [
        ("all", 5, 0, 5),  # rows 0..4
        ("some", 3, 0, 3),  # rows 5..7
        ("unsorted", 4, 2, 2),  # rows 8..9 (prefix-cache hit of 2)
        ("default", 2, 0, 2),  # rows 10..11
        ("plain", 3, 0, 3),
    ]
    step(
        capture,
        runner,
        batch,
        new={
            "all": xargs(key(1), layers=[0, 2, FINAL], pooling="last"),
            "some": xargs(key(2), layers=[2]),
            "unsorted": xargs(key(3), layers=[FINAL, 0]),
            "default": key(4),
            "plain": None,
        },
    )
    assert writer.publish_count() == 4
    assert_last_record(reader.lookup(key(1)), row=4, prompt_len=5, layers=(0, 2, FINAL))
    assert_last_record(reader.lookup(key(2)), row=7, prompt_len=3, layers=(2,))
    assert_last_record(reader.lookup(key(3)), row=9, prompt_len=4, layers=(0, FINAL))
    assert_last_record(reader.lookup(key(4)), row=11, prompt_len=2, layers=(FINAL,))
    assert capture.selected.pending == {}


def test_intermediate_layers_follow_the_chunk_that_holds_p_minus_1(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=torch.bfloat16)
    flag = xargs(key(1), layers=[0, 2])
    step(capture, runner, [("x", 6, 0, 6), ("c", 9, 0, 5)], new={"x": None, "c": flag})
    assert writer.publish_count() == 0
    starts = step(capture, runner, [("x", 6, 6, 1), ("c", 9, 5, 4)])
    assert_last_record(reader.lookup(key(1)), row=starts["c"] + 3, prompt_len=9, layers=(0, 2))


# -- what a flagged request cannot get becomes an error record ------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"layers": "4"}, "malformed layer list '4'"),
        ({"layers": []}, "malformed layer list []"),
        ({"layers": [True]}, "malformed layer list [True]"),
        ({"layers": [2.0]}, "malformed layer list [2.0]"),
        ({"layers": [0, 0]}, "malformed layer list [0, 0]"),
        (
            {"layers": [1, 2]},
            "layers [1] are not captured by this vLLM engine (it captures 0, 2, 4",
        ),
        ({"layers": [-1]}, "layers [-1] are not captured"),  # the proxy sends absolute indices
        ({"pooling": "max"}, "unknown pooling 'max'"),
        ({"pooling": None, "layers": [FINAL]}, None),  # None: the default pooling, no problem
        ({"pooling": ["mean"]}, "unknown pooling ['mean']"),
    ],
)
def test_a_request_the_engine_cannot_serve_gets_an_error_record_at_once(
    writer: RingWriter, reader: RingReader, extra: dict[str, Any], message: str | None
) -> None:
    runner, capture = v1_capture(writer)
    flag = xargs(key(1), **extra)
    # The first chunk of a long prompt: the answer need not wait for the last one.
    step(
        capture,
        runner,
        [("bad", 20, 0, 4), ("good", 3, 0, 3)],
        new={"bad": flag, "good": key(2)},
    )
    assert_last_record(reader.lookup(key(2)), row=6, prompt_len=3)
    if message is None:
        assert reader.lookup(key(1)) is None
        assert pending_keys(capture) == {"bad": key(1)}
        return
    assert message in error_of(reader.lookup(key(1))).message
    assert writer.publish_count() == 2
    assert capture.selected.pending == {}
    # Not answered twice, even when its prompt completes later.
    step(capture, runner, [("bad", 20, 4, 16)])
    assert writer.publish_count() == 2


def test_siblings_with_a_problem_share_one_error_record(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer)
    flag = xargs(key(3), layers=[1])
    step(capture, runner, [("0_p", 4, 0, 4), ("1_p", 4, 0, 4)], new={"0_p": flag, "1_p": flag})
    assert "not captured" in error_of(reader.lookup(key(3))).message
    assert writer.publish_count() == 1
    assert capture.selected.pending == {}
    step(capture, runner, [("2_p", 4, 3, 1)], new={"2_p": flag})  # a late child
    assert writer.publish_count() == 1


class RaisingView(V1RunnerView):
    def scheduled(self, runner: Any, scheduler_output: Any, wanted: Any) -> Any:
        raise RuntimeError("runner internals changed")


def test_a_failing_view_is_contained_logged_once_and_answers_the_steps_keys(
    writer: RingWriter, reader: RingReader, hook_log: HookLog
) -> None:
    runner, capture = v1_capture(writer, view=RaisingView())
    step(
        capture,
        runner,
        [("a", 3, 0, 3), ("b", 30, 0, 2), ("plain", 2, 0, 2)],
        new={"a": key(1), "b": key(2), "plain": None},
    )
    assert capture.selected.pending == {}
    assert error_of(reader.lookup(key(1))).message == STEP_FAILED
    assert error_of(reader.lookup(key(2))).message == STEP_FAILED
    [logged] = error_logs(hook_log)
    assert logged.exc_info is not None
    assert "capturing a step's hidden states" in logged.getMessage()
    # Next failing step: still contained and answered, not logged again.
    step(capture, runner, [("c", 4, 0, 4)], new={"c": key(3)})
    assert error_of(reader.lookup(key(3))).message == STEP_FAILED
    assert len(error_logs(hook_log)) == 1
    assert writer.publish_count() == 3
    # The failed requests are not published later by a working view either.
    capture.view = V1RunnerView()
    step(capture, runner, [("a", 3, 0, 3)])
    assert writer.publish_count() == 3


@pytest.mark.parametrize("aux", [None, "one short"])
def test_auxiliary_outputs_that_are_not_the_configured_ones_fail_the_step(
    writer: RingWriter, reader: RingReader, hook_log: HookLog, aux: str | None
) -> None:
    runner, capture = v1_capture(writer)
    # The model returns fewer auxiliary layers than the capture asked for (or none at all).
    runner.captured = CapturedLayers(FINAL, (2, FINAL)) if aux else CapturedLayers(FINAL, (FINAL,))
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    assert error_of(reader.lookup(key(1))).message == STEP_FAILED
    [logged] = error_logs(hook_log)
    assert logged.exc_info is not None
    assert "auxiliary hidden states, not the 2 of layers [0, 2]" in str(logged.exc_info[1])


class FailingOnce:
    """A copier whose ``number``-th copy cannot start (e.g. no pinned memory left)."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.starts = 0

    def start(self, rows: Any) -> PendingRows:
        self.starts += 1
        if self.starts == self.number:
            raise RuntimeError("cannot allocate pinned memory")
        return SyncRowCopier().start(rows)


def test_a_step_copy_failure_answers_exactly_that_steps_keys(
    writer: RingWriter, reader: RingReader, hook_log: HookLog
) -> None:
    runner, capture = v1_capture(writer, copier=FailingOnce(2))
    step(
        capture,
        runner,
        [("a", 3, 0, 3), ("later", 10, 0, 4)],
        new={"a": key(1), "later": key(5)},
    )
    assert_last_record(reader.lookup(key(1)), row=2, prompt_len=3)
    # Step 2: "b" and "c" complete (their copy fails), "d" runs its first chunk.
    step(
        capture,
        runner,
        [("b", 2, 0, 2), ("c", 3, 0, 3), ("d", 20, 0, 4)],
        new={"b": xargs(key(2), layers=[0, FINAL]), "c": key(3), "d": key(4)},
    )
    for k in (key(2), key(3), key(4)):
        assert error_of(reader.lookup(k)).message == STEP_FAILED
    [logged] = error_logs(hook_log)
    assert logged.exc_info is not None
    assert "cannot allocate pinned memory" in str(logged.exc_info[1])
    # "later" was not in that step: it is still served.
    assert pending_keys(capture) == {"later": key(5)}
    starts = step(capture, runner, [("later", 10, 4, 6)])
    assert_last_record(reader.lookup(key(5)), row=starts["later"] + 5, prompt_len=10)
    assert writer.publish_count() == 5
    # Nothing of the failed step is taken again.
    step(capture, runner, [("b", 2, 0, 2), ("c", 3, 0, 3)])
    assert writer.publish_count() == 5


def test_unreadable_scheduler_output_is_contained(writer: RingWriter, hook_log: HookLog) -> None:
    class Broken:
        def __init__(self) -> None:
            self.finished_req_ids: set[str] = set()
            self.num_scheduled_tokens: dict[str, int] = {}

        @property
        def scheduled_new_reqs(self) -> list[Any]:
            raise AttributeError("renamed in a later vLLM")

    runner, capture = v1_capture(writer)
    capture.after_execute_model(runner, Broken())
    capture.after_execute_model(runner, Broken())
    [logged] = error_logs(hook_log)
    assert "scheduler output" in logged.getMessage()


class UntouchableView(V1RunnerView):
    def check(self, runner: Any) -> None:
        raise AssertionError("a non-publishing rank must not check the runner")

    def scheduled(self, runner: Any, scheduler_output: Any, wanted: Any) -> Any:
        raise AssertionError("a non-publishing rank must not read the runner")


def test_non_publishing_rank_does_nothing(hook_log: HookLog) -> None:
    capture = StepCapture(UntouchableView(), None, MODEL)
    assert not capture.publishing
    assert capture.publications is None
    runner = FakeV1Runner()
    step(capture, runner, [("a", 3, 0, 3)], new={"a": key(1)})
    assert capture.selected.pending == {}  # not even tracked
    # Neither runner nor scheduler output is touched at all.
    capture.after_execute_model(object(), object())
    capture.after_sample_tokens(object())
    assert hook_log.records == []


# -- "mean" pooling -------------------------------------------------------------------------------


def assert_mean_record(
    reader: RingReader,
    k: bytes,
    runner: FakeV1Runner,
    req_id: str,
    *,
    prompt_len: int,
    layers: tuple[int, ...],
) -> None:
    record = record_of(reader.lookup(k))
    assert record.pooling == "mean"
    assert record.layers == layers
    assert record.position == prompt_len - 1
    assert record.num_prompt_tokens == prompt_len
    for layer in layers:
        expected = runner.expected_mean(req_id, prompt_len, layer)
        np.testing.assert_allclose(record.floats(layer), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_over_chunked_prefill_of_several_layers(
    dtype: torch.dtype, writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=dtype, content=by_position)
    flag = xargs(key(1), layers=[0, 2, FINAL], pooling="mean")
    # P = 10 in chunks of 4, 4, 2, with other requests around it.
    step(capture, runner, [("x", 3, 0, 3), ("m", 10, 0, 4)], new={"x": None, "m": flag})
    step(capture, runner, [("m", 10, 4, 4), ("x", 3, 3, 1)])
    assert writer.publish_count() == 0
    assert len(capture.means) == 1
    step(capture, runner, [("y", 2, 0, 2), ("m", 10, 8, 2)], new={"y": None})
    assert writer.publish_count() == 1
    assert_mean_record(reader, key(1), runner, "m", prompt_len=10, layers=(0, 2, FINAL))
    assert len(capture.means) == 0
    assert capture.selected.pending == {}
    # Decode steps add nothing.
    step(capture, runner, [("m", 10, 10, 1)])
    assert writer.publish_count() == 1


def test_mean_of_a_one_step_prompt_next_to_last_requests(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=torch.bfloat16, content=by_position)
    step(
        capture,
        runner,
        [("l", 4, 0, 4), ("m", 3, 0, 3), ("l2", 2, 0, 2)],
        new={
            "l": xargs(key(1), layers=[2, FINAL]),
            "m": xargs(key(2), layers=[0], pooling="mean"),
            "l2": key(3),
        },
    )
    assert writer.publish_count() == 3
    assert_mean_record(reader, key(2), runner, "m", prompt_len=3, layers=(0,))
    # The "last" records are the bfloat16 rows of position P - 1, exactly.
    for k, req_id, prompt_len, layers in (
        (key(1), "l", 4, (2, FINAL)),
        (key(3), "l2", 2, (FINAL,)),
    ):
        record = record_of(reader.lookup(k))
        assert record.pooling == "last"
        for layer in layers:
            held = runner.layer_tensor([(req_id, -1, prompt_len - 1)], layer).float()
            assert record.floats(layer) == held[0].tolist()


def test_mean_after_preemption_skips_the_recomputed_positions(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=torch.float32, content=by_position)
    flag = xargs(key(1), layers=[0, FINAL], pooling="mean")
    step(capture, runner, [("m", 12, 0, 8)], new={"m": flag})  # positions 0..7 summed
    step(capture, runner, [("x", 2, 0, 2)], new={"x": None})  # "m" preempted
    # Re-prefilled from scratch in chunks: 0..3 (all seen), 4..11 (8..11 new).
    step(capture, runner, [("m", 12, 0, 4)])
    assert writer.publish_count() == 0
    step(capture, runner, [("m", 12, 4, 8)])
    assert writer.publish_count() == 1
    # Repeated positions counted twice would move the mean away from this.
    assert_mean_record(reader, key(1), runner, "m", prompt_len=12, layers=(0, FINAL))


@pytest.mark.parametrize(
    ("steps", "gap"),
    [
        ([(4, 4)], "positions 0..3 were served from the prefix cache"),
        ([(0, 4), (8, 4)], "positions 4..7 were served from the prefix cache"),
    ],
)
def test_mean_with_positions_served_from_the_prefix_cache_is_an_error_record(
    writer: RingWriter, reader: RingReader, steps: list[tuple[int, int]], gap: str
) -> None:
    runner, capture = v1_capture(writer, content=by_position)
    flag = xargs(key(1), pooling="mean")
    for number, (nc, ns) in enumerate(steps):
        step(capture, runner, [("m", 12, nc, ns)], new={"m": flag} if number == 0 else None)
    error = error_of(reader.lookup(key(1)))
    assert gap in error.message
    assert "this pooling needs all 12 prompt positions" in error.message
    assert error.status == 409  # the proxy sends a prompt of a list that hit another's alone
    assert writer.publish_count() == 1
    assert capture.selected.pending == {}
    assert len(capture.means) == 0


def test_a_mean_gap_leaves_the_key_to_a_pending_sibling(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, content=by_position)
    flag = xargs(key(1), pooling="mean")
    # n = 2: child 1 got a prefix-cache hit (a gap), child 0 computes the whole prompt.
    step(capture, runner, [("0_m", 8, 0, 4), ("1_m", 8, 4, 4)], new={"0_m": flag, "1_m": flag})
    assert writer.publish_count() == 0
    assert pending_keys(capture) == {"0_m": key(1)}
    step(capture, runner, [("0_m", 8, 4, 4), ("1_m", 8, 8, 1)])
    assert writer.publish_count() == 1
    # The mean is child 0's (the fake gives each child rows of its own, to tell them apart).
    assert_mean_record(reader, key(1), runner, "0_m", prompt_len=8, layers=(FINAL,))


def test_a_mean_gap_in_every_sibling_is_one_error_record(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, content=by_position)
    flag = xargs(key(1), pooling="mean")
    step(capture, runner, [("0_m", 8, 2, 6), ("1_m", 8, 4, 4)], new={"0_m": flag, "1_m": flag})
    assert "served from the prefix cache" in error_of(reader.lookup(key(1))).message
    assert writer.publish_count() == 1
    assert capture.selected.pending == {}


def test_a_mean_request_that_finishes_mid_prompt_leaves_no_sum(writer: RingWriter) -> None:
    runner, capture = v1_capture(writer, content=by_position)
    step(capture, runner, [("m", 12, 0, 4)], new={"m": xargs(key(1), pooling="mean")})
    assert len(capture.means) == 1
    step(capture, runner, [("x", 2, 0, 2)], new={"x": None}, finished=["m"])
    assert len(capture.means) == 0
    assert writer.publish_count() == 0


def test_a_request_id_reused_in_the_step_its_first_use_finished_starts_a_new_mean(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = v1_capture(writer, dtype=torch.float32, content=by_position)
    step(capture, runner, [("r", 8, 0, 4)], new={"r": xargs(key(1), pooling="mean")})

    def other_prompt(req_id: str, row: int, position: int, layer: int) -> list[float]:
        return by_position("another " + req_id, row, position, layer)

    runner.content = other_prompt
    step(
        capture,
        runner,
        [("r", 6, 0, 6)],
        new={"r": xargs(key(2), pooling="mean")},
        finished=["r"],
    )
    assert reader.lookup(key(1)) is None
    assert_mean_record(reader, key(2), runner, "r", prompt_len=6, layers=(FINAL,))


# -- StepCapture.for_runner: the engine's ring, or a failure note in its place ---------------------


@pytest.fixture
def for_runner() -> Any:
    """``StepCapture.for_runner``, whose rings are closed after the test."""
    made: list[StepCapture] = []

    def start(runner: Any, view: Any = None) -> StepCapture:
        capture = StepCapture.for_runner(runner, view or V1RunnerView())
        made.append(capture)
        return capture

    yield start
    for capture in made:
        if capture.writer is not None:
            capture.writer.close()


def engine_config(engine: int, **parallel: int) -> Any:
    config = fake_vllm_config(instance_id="for-runner-test")
    config.parallel_config.data_parallel_index = engine
    for name, value in parallel.items():
        setattr(config.parallel_config, name, value)
    return config


def test_the_publishing_rank_creates_its_engines_ring(ring_env: Path, for_runner: Any) -> None:
    runner = FakeV1Runner(vllm_config=engine_config(3))
    capture = for_runner(runner)
    assert capture.publishing
    assert capture.model_name == MODEL  # the first served name
    instance = instance_of(runner.vllm_config)
    assert capture.writer.path == ring_env / ring_name(instance, 3)
    with RingReader.open(capture.writer.path) as ring:
        assert (ring.header.instance, ring.header.engine) == (instance, 3)
        assert ring.hidden_size == HIDDEN
        assert ring.slot_count == 8
        assert ring.layers == (FINAL,)  # HIDDEN_STATE_PROXY_LAYERS unset: the final layer only
        # What `check` and /metrics show: the vLLM and the runner the hook wraps.
        assert ring.header.runner == f"vLLM {vllm.__version__} V1 FakeV1Runner"
    assert capture.captured == CapturedLayers(FINAL, (FINAL,))
    # The same engine of another instance (vLLM server) in the same directory: a second ring.
    other = FakeV1Runner(vllm_config=engine_config(3))
    other.vllm_config.instance_id = "another server"
    assert for_runner(other).writer.path != capture.writer.path
    with RingDirectory(ring_env) as directory:
        assert directory.live_ring_count() == 2


def live_note(ring_dir: Path, config: Any) -> Any:
    engine = config.parallel_config.data_parallel_index
    note = read_live_note(ring_dir / note_name(instance_of(config), engine), None)
    assert note is not None, "no live failure note"
    return note


def test_an_unsupported_runner_leaves_a_failure_note_naming_engine_and_cause(
    ring_env: Path, for_runner: Any
) -> None:
    runner = FakeV1Runner(vllm_config=engine_config(2))
    del runner.input_batch.num_prompt_tokens  # e.g. a vLLM version that renamed it
    with pytest.raises(UnsupportedRunner, match="num_prompt_tokens"):
        for_runner(runner)
    assert not list(ring_env.glob("*.bin"))
    note = live_note(ring_env, runner.vllm_config)
    assert note.engine == 2
    assert note.message == (
        "UnsupportedRunner: the V1 input batch has no num_prompt_tokens "
        f"[vLLM {vllm.__version__}, V1 model runner]"
    )
    assert not note.refused_settings  # not the operator's settings, but this vLLM:
    assert note.fatal  # it will not start working by itself (/health 503, serve exits)
    with RingDirectory(ring_env) as directory:
        [failure] = directory.failed_engines()
        assert failure == note
        assert "engine 2 (data-parallel index)" in failure.describe()
        assert "num_prompt_tokens" in failure.describe()


def test_a_required_hook_makes_every_note_fatal(
    ring_env: Path, for_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HIDDEN_STATE_PROXY_HOOK=1: the operator wants vectors, so even a ring that cannot be
    created (not a refusal) keeps /health at 503 and stops serve."""
    monkeypatch.setenv(HOOK_ENABLED_ENV, "1")
    monkeypatch.setenv(RING_SLOTS_ENV, "0")
    config = engine_config(1)
    with pytest.raises(ValueError, match="slot_count must be in"):
        for_runner(FakeV1Runner(vllm_config=config))
    note = live_note(ring_env, config)
    assert note.fatal and not note.refused_settings


@pytest.mark.parametrize(
    ("setup", "error", "cause", "refused"),
    [
        ("slots", ValueError, "slot_count must be in", False),
        ("in use", RingInUseError, "is held by a live writer", False),
        ("context parallel", RefusedSettings, "prefill_context_parallel_size=2", True),
        ("pooling", RefusedSettings, "runs this model as a pooling model", True),
        ("mode", ValueError, f"{RING_DIR_MODE_ENV}='rw-r' is not an octal mode", False),
    ],
)
def test_a_ring_that_cannot_start_leaves_a_note(
    ring_env: Path,
    for_runner: Any,
    monkeypatch: pytest.MonkeyPatch,
    setup: str,
    error: type[Exception],
    cause: str,
    refused: bool,
) -> None:
    config = engine_config(1)
    held = None
    if setup == "slots":
        monkeypatch.setenv(RING_SLOTS_ENV, "0")
    elif setup == "mode":  # the note is still written (with the default, private modes)
        monkeypatch.setenv(RING_DIR_MODE_ENV, "rw-r")
    elif setup == "in use":  # the same instance and engine already publish there
        held = RingWriter.create(
            ring_env,
            hidden_size=HIDDEN,
            model=MODEL,
            slot_count=2,
            instance=instance_of(config),
            engine=1,
        )
    elif setup == "pooling":  # --runner pooling: no step keeps hidden states for the hook
        config.model_config.runner_type = "pooling"
    else:
        config.parallel_config.prefill_context_parallel_size = 2
    try:
        with pytest.raises(error, match=cause):
            for_runner(FakeV1Runner(vllm_config=config))
        note = live_note(ring_env, config)
        assert note.engine == 1
        assert note.message.startswith(error.__name__ + ": ")
        assert cause in note.message
        assert note.refused_settings is refused
        assert note.fatal is refused  # a full disk, say, may pass: only refusals are fatal
    finally:
        if held is not None:
            held.close()


def test_a_directory_shared_with_a_server_of_another_model_is_refused(
    ring_env: Path, for_runner: Any
) -> None:
    """Another vLLM server publishes vectors of another size there: its proxy and ours could not
    tell whose rings are whose, so this engine refuses (serve stops on the note)."""
    other = RingWriter.create(
        ring_env, hidden_size=HIDDEN * 2, model="other-model", slot_count=2, instance=0xBEEF
    )
    try:
        config = engine_config(0)
        with pytest.raises(RingDirectoryConflict, match="shared with another vLLM server"):
            for_runner(FakeV1Runner(vllm_config=config))
        assert [path.name for path in ring_env.glob("*.bin")] == [other.path.name]
        note = live_note(ring_env, config)
        assert note.refused_settings
        assert f"instance {0xBEEF:016x}" in note.message
    finally:
        other.close()


def test_layers_the_model_cannot_return_leave_a_refusal(
    ring_env: Path, for_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's own settings cannot be served: the note says so (serve stops on it)."""
    monkeypatch.setenv(LAYERS_ENV, "0,99")
    config = engine_config(0)
    with pytest.raises(LayerConfigError, match="out of range"):
        for_runner(FakeV1Runner(vllm_config=config))
    note = live_note(ring_env, config)
    assert note.refused_settings
    assert note.message.startswith("LayerConfigError: HIDDEN_STATE_PROXY_LAYERS='0,99'")


def test_when_not_even_a_note_can_be_written_the_error_still_propagates(
    ring_env: Path, for_runner: Any, hook_log: HookLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setenv(RING_SLOTS_ENV, "0")
    monkeypatch.setattr(FailureNote, "write", no_space)
    notes = len(ring_start._NOTES)
    with pytest.raises(ValueError, match="slot_count"):
        for_runner(FakeV1Runner(vllm_config=engine_config(0)))
    assert len(ring_start._NOTES) == notes
    [warning] = [r for r in hook_log.records if r.levelno == logging.WARNING]
    assert "could not leave a failure note" in warning.getMessage()


NOBODY = 65534


def _untrusted(ring_env: Path, how: str) -> None:
    ring_env.parent.mkdir(parents=True, exist_ok=True)
    if how == "not a directory":
        ring_env.write_text("not a directory")
        return
    if how == "symlink":
        real = ring_env.parent / "elsewhere"
        real.mkdir(mode=0o700)
        ring_env.symlink_to(real)
        return
    ring_env.mkdir()
    if how == "sticky world-writable":
        os.chmod(ring_env, 0o1777)
    else:  # another local user's directory at the (guessable) path
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(ring_env, NOBODY, -1)


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("not a directory", "is not a directory"),
        ("symlink", "is a symbolic link"),
        ("sticky world-writable", "/tmp-like"),
        ("foreign", f"owned by uid {NOBODY}"),
    ],
)
def test_an_untrusted_directory_gets_no_ring_no_note_and_a_log_line_saying_why(
    ring_env: Path, for_runner: Any, hook_log: HookLog, how: str, why: str
) -> None:
    _untrusted(ring_env, how)
    before = sorted(os.listdir(ring_env.parent))
    notes = len(ring_start._NOTES)
    with pytest.raises(UntrustedDirectory, match=why):
        for_runner(FakeV1Runner(vllm_config=engine_config(0)))
    assert len(ring_start._NOTES) == notes  # a note there could not be trusted
    assert sorted(os.listdir(ring_env.parent)) == before
    if ring_env.is_dir():
        assert os.listdir(ring_env) == []
    [error] = [r for r in hook_log.records if r.levelno == logging.ERROR]
    message = error.getMessage()
    assert "no ring for engine 0" in message and why in message and str(ring_env) in message
    assert RING_DIR_ENV in message


def test_a_world_writable_directory_of_its_own_is_repaired_and_used(
    ring_env: Path, for_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes emptyDir (fsGroup) is created drwxrwsrwx: the hook, its owner, takes the
    write permissions its settings do not ask for away before it publishes there."""
    ring_env.mkdir(parents=True)
    os.chmod(ring_env, 0o2777)
    monkeypatch.setenv(RING_DIR_MODE_ENV, "0770")
    capture = for_runner(FakeV1Runner(vllm_config=engine_config(0)))
    assert capture.publishing
    assert stat.S_IMODE(ring_env.stat().st_mode) == 0o2775
    with RingDirectory(ring_env) as directory:  # the proxy's view: trusted now
        assert directory.live_ring_count() == 1


def test_a_held_directory_lock_leaves_a_refusal_within_the_timeout(
    ring_env: Path, for_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local user holding the directory's lock used to hang vLLM's startup for good: the
    hook gives up at the deadline and says who holds it (serve exits on the refusal)."""
    ring_env.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv(RING_LOCK_TIMEOUT_ENV, "0.3")
    config = engine_config(0)
    with directory_lock_held(ring_env) as pid:
        started = time.monotonic()
        with pytest.raises(DirectoryLocked, match="held by"):
            for_runner(FakeV1Runner(vllm_config=config))
        assert time.monotonic() - started < 10
        note = live_note(ring_env, config)
    assert note.refused_settings
    assert note.message.startswith("DirectoryLocked: the lock of the ring directory")
    assert str(ring_env) in note.message and "more than 0.3 s" in note.message
    if Path("/proc/locks").exists():
        assert f"held by pid {pid} " in note.message
    assert not list(ring_env.glob("*.bin"))


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_malformed_lock_timeout_leaves_a_note(
    ring_env: Path, for_runner: Any, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(RING_LOCK_TIMEOUT_ENV, raw)
    config = engine_config(0)
    with pytest.raises(ValueError, match=RING_LOCK_TIMEOUT_ENV):
        for_runner(FakeV1Runner(vllm_config=config))
    assert RING_LOCK_TIMEOUT_ENV in live_note(ring_env, config).message
