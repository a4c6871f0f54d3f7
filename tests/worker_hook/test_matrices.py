"""Matrices in the worker (capture.StepCapture with pooling.PromptMatrix, answer_rows and
matrix_budget): every prompt position's rows across prefill chunks, every answer position's
rows per choice, their bytes bounded before any row is kept (413 one request, 503 the engine)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

from tests.worker_hook.fakes import (
    CAPTURED,
    FINAL,
    HIDDEN,
    MODEL,
    FakeV1Runner,
    by_position,
    error_of,
    key,
    record_of,
    step,
    xargs,
)
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    CHOICES_ENTRY,
    DEVICE_MIB_ENV,
    MAX_RECORD_MIB_ENV,
    SPANS_ENTRY,
    all_answer_key,
)
from vllm_hidden_state_proxy.ring import RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView

K = key(5)
LAYERS = [0, FINAL]
ROW_BYTES = 4 * HIDDEN


def arena_ring(directory: Path, arena: int, max_record: int | None = None) -> RingWriter:
    return RingWriter.create(
        directory,
        hidden_size=HIDDEN,
        model=MODEL,
        slot_count=32,
        num_hidden_layers=CAPTURED.num_hidden_layers,
        layers=CAPTURED.layers,
        arena_size=arena,
        max_record=max_record,
    )


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[RingWriter, RingReader]]:
    with arena_ring(tmp_path, 1 << 20) as writer, RingReader.open(writer.path) as reader:
        yield writer, reader


def capture_of(writer: RingWriter, device_limit: int = 1 << 30) -> tuple[FakeV1Runner, StepCapture]:
    runner = FakeV1Runner(torch.float32, content=by_position)
    capture = StepCapture(
        V1RunnerView(), writer, MODEL, captured=CAPTURED, device_limit=device_limit
    )
    return runner, capture


def rows_of(req_id: str, positions: range, layer: int) -> bytes:
    return b"".join(
        struct.pack(f"<{HIDDEN}f", *by_position(req_id, 0, position, layer))
        for position in positions
    )


def test_all_prompt_joins_every_chunk_layer_after_layer(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    args = xargs(K, pooling="all_prompt", layers=LAYERS)
    step(capture, runner, [("x", 3, 0, 3), ("a", 10, 0, 4)], new={"a": args})
    assert writer.publish_count() == 0
    step(capture, runner, [("a", 10, 4, 4)])
    step(capture, runner, [("a", 10, 8, 2), ("x", 3, 3, 1)])
    record = record_of(reader.lookup(K))
    assert (record.pooling, record.rows, record.position, record.num_prompt_tokens) == (
        "all_prompt",
        10,
        0,
        10,
    )
    for layer in LAYERS:
        assert record.vector(layer) == rows_of("a", range(10), layer)
    assert len(capture.matrices) == len(capture.budget) == 0


def test_all_prompt_with_positions_from_the_prefix_cache_is_an_error(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    args = xargs(K, pooling="all_prompt")
    step(capture, runner, [("a", 10, 4, 6)], new={"a": args})  # 0..3 from the cache
    error = error_of(reader.lookup(K))
    assert "prefix cache" in error.message and error.status == 409
    assert len(capture.matrices) == len(capture.budget) == 0


def test_a_matrix_over_the_max_record_is_a_413_before_any_row_is_kept(tmp_path: Path) -> None:
    with (
        arena_ring(tmp_path, 1 << 20, 9 * ROW_BYTES) as writer,
        RingReader.open(writer.path) as reader,
    ):
        runner, capture = capture_of(writer)
        step(capture, runner, [("a", 10, 0, 4)], new={"a": xargs(K, pooling="all_prompt")})
        error = error_of(reader.lookup(K))
        assert error.status == 413 and MAX_RECORD_MIB_ENV in error.message
        assert "10 rows" in error.message
        assert len(capture.matrices) == len(capture.budget) == 0
        step(capture, runner, [("a", 10, 4, 6)])  # the rest of it: nothing more published
        assert writer.publish_count() == 1


def test_matrices_together_past_the_arena_are_a_503(tmp_path: Path) -> None:
    block = 64 + 12 * ROW_BYTES  # 12 rows of 4 floats and the block's header: 256 bytes
    with (
        arena_ring(tmp_path, 7 * 64, block) as writer,
        RingReader.open(writer.path) as reader,
    ):  # 448 bytes: two blocks of 12 rows do not fit together
        runner, capture = capture_of(writer)
        other = key(6)
        new = {"a": xargs(K, pooling="all_prompt"), "b": xargs(other, pooling="all_prompt")}
        step(capture, runner, [("a", 12, 0, 4), ("b", 12, 0, 4)], new=new)
        error = error_of(reader.lookup(other))
        assert error.status == 503 and ARENA_MIB_ENV in error.message
        step(capture, runner, [("a", 12, 4, 8)])
        assert record_of(reader.lookup(K)).rows == 12
        assert len(capture.budget) == 0


def test_a_server_without_an_arena_answers_matrices_with_a_503(tmp_path: Path) -> None:
    with arena_ring(tmp_path, 0) as writer, RingReader.open(writer.path) as reader:
        runner, capture = capture_of(writer)
        step(capture, runner, [("a", 5, 0, 5)], new={"a": xargs(K, pooling="all_prompt")})
        error = error_of(reader.lookup(K))
        assert error.status == 503 and f"{ARENA_MIB_ENV}=0" in error.message


def answer_args(choices: int = 1) -> dict[str, object]:
    args = xargs(K, pooling="all_answer", layers=LAYERS)
    if choices > 1:
        args[CHOICES_ENTRY] = choices
    return args


def test_all_answer_keeps_every_sampling_position_per_choice(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    new = {"0_p": answer_args(2), "1_p": answer_args(2)}
    step(capture, runner, [("0_p", 4, 0, 2), ("1_p", 4, 0, 4)], new=new)
    step(capture, runner, [("0_p", 4, 2, 2), ("1_p", 4, 4, 1)])
    step(capture, runner, [("0_p", 4, 4, 1), ("1_p", 4, 5, 1)])
    step(capture, runner, [("1_p", 4, 6, 1)], finished=["0_p"])
    step(capture, runner, [], finished=["1_p"])
    for choice, last in ((0, 4), (1, 6)):
        record = record_of(reader.lookup(all_answer_key(K, choice)))
        assert (record.pooling, record.position, record.rows) == ("all_answer", 3, last - 2)
        for layer in LAYERS:
            assert record.vector(layer) == rows_of(f"{choice}_p", range(3, last + 1), layer)
    assert len(capture.answers) == len(capture.budget) == 0


def test_all_answer_keeps_no_position_past_max_tokens(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)  # the fake's max_tokens is 8
    step(capture, runner, [("a", 3, 0, 3)], new={"a": answer_args()})
    for done in range(10):  # positions 3..12: 2..9 choose tokens 1..8; 10 and past, none
        step(capture, runner, [("a", 3, 3 + done, 1)])
    step(capture, runner, [], finished=["a"])
    record = record_of(reader.lookup(all_answer_key(K, 0)))
    assert (record.position, record.rows) == (2, 8)
    assert record.vector(FINAL) == rows_of("a", range(2, 10), FINAL)


def test_all_answer_over_the_max_record_is_a_413_at_once(tmp_path: Path) -> None:
    with (
        arena_ring(tmp_path, 1 << 20, 2 * 7 * ROW_BYTES) as writer,
        RingReader.open(writer.path) as reader,
    ):  # two layers of 8 rows (max_tokens) do not fit in 2 x 7
        runner, capture = capture_of(writer)
        step(capture, runner, [("a", 3, 0, 3)], new={"a": answer_args()})
        error = error_of(reader.lookup(K))
        assert error.status == 413 and MAX_RECORD_MIB_ENV in error.message
        assert len(capture.answers) == len(capture.budget) == 0


def span_means(req_id: str, spans: list[list[int]], layer: int) -> npt.NDArray[np.float32]:
    rows = np.array(
        [by_position(req_id, 0, position, layer) for position in range(max(e for _, e in spans))]
    )
    return np.array([rows[s:e].mean(axis=0) for s, e in spans], dtype=np.float32)


def test_spans_are_mean_pooled_across_chunks_in_the_worker(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    spans = [[0, 10], [2, 5], [3, 7], [9, 10], [4, 5]]  # within, across and at chunk ends
    flat = [position for span in spans for position in span]
    args = {**xargs(K, pooling="spans", layers=LAYERS), SPANS_ENTRY: flat}
    step(capture, runner, [("x", 3, 0, 3), ("a", 10, 0, 4)], new={"a": args})
    step(capture, runner, [("a", 10, 4, 3)])
    assert writer.publish_count() == 0
    step(capture, runner, [("a", 10, 7, 3)])
    record = record_of(reader.lookup(K))
    assert (record.pooling, record.rows, record.num_prompt_tokens) == ("spans", 5, 10)
    for layer in LAYERS:
        got = np.frombuffer(record.vector(layer), "<f4").reshape(len(spans), HIDDEN)
        np.testing.assert_allclose(got, span_means("a", spans, layer), rtol=1e-5, atol=1e-5)
    assert len(capture.spans) == len(capture.budget) == 0


def test_a_span_past_the_prompt_is_a_400(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    args = {**xargs(K, pooling="spans"), SPANS_ENTRY: [0, 2, 3, 11]}
    step(capture, runner, [("a", 10, 0, 10)], new={"a": args})
    error = error_of(reader.lookup(K))
    assert error.status == 400 and "[3, 11]" in error.message and "10 tokens" in error.message
    assert len(capture.spans) == len(capture.budget) == 0


@pytest.mark.parametrize(
    "spans", [[], [3, 3], [1], [-1, 2], "0:2", [0, True], [[0, 2]], [0, 1] * 1025]
)
def test_malformed_spans_are_an_error_record(
    ring: tuple[RingWriter, RingReader], spans: object
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer)
    args = {**xargs(K, pooling="spans"), SPANS_ENTRY: spans}
    step(capture, runner, [("a", 10, 0, 10)], new={"a": args})
    assert "malformed spans" in error_of(reader.lookup(K)).message


# -- the arena's reservation counts blocks and wrap-around; the device's, kept rows ----------


@pytest.mark.parametrize("arena", [16 * ROW_BYTES, 1 << 20])
def test_a_matrix_of_exactly_the_max_record_is_a_413_before_any_row_is_kept(
    tmp_path: Path, arena: int
) -> None:
    """The max record counts the block's 64-byte header: 16 rows of exactly the max record
    are refused when first seen (they were accepted, then failed to be written: a 502 after
    the work, where the max record is the arena's size)."""
    with (
        arena_ring(tmp_path, arena, 16 * ROW_BYTES) as writer,
        RingReader.open(writer.path) as reader,
    ):
        runner, capture = capture_of(writer)
        step(capture, runner, [("a", 16, 0, 4)], new={"a": xargs(K, pooling="all_prompt")})
        error = error_of(reader.lookup(K))
        assert error.status == 413 and MAX_RECORD_MIB_ENV in error.message, error
        assert "16 rows" in error.message
        assert len(capture.matrices) == len(capture.budget) == len(capture.device) == 0
        step(capture, runner, [("a", 16, 4, 12)])
        assert writer.publish_count() == 1
        assert writer.space.reserved == 0


def test_matrices_that_would_wrap_the_arena_are_refused_at_reservation(tmp_path: Path) -> None:
    """Four matrices of a quarter of the arena each, gathered in one step: their rows fit the
    arena, their blocks do not. The fourth is a 503 when it is first seen; the first three are
    read whole (the fourth used to wrap round and write the first over before it was read)."""
    with arena_ring(tmp_path, 4 * 16 * ROW_BYTES) as writer, RingReader.open(writer.path) as reader:
        runner, capture = capture_of(writer)
        keys = {req_id: key(10 + n) for n, req_id in enumerate("abcd")}
        new = {req_id: xargs(k, pooling="all_prompt") for req_id, k in keys.items()}
        step(capture, runner, [(req_id, 16, 0, 16) for req_id in keys], new=new)
        for req_id in "abc":
            record = record_of(reader.lookup(keys[req_id]))
            assert record.vector(FINAL) == rows_of(req_id, range(16), FINAL)
        error = error_of(reader.lookup(keys["d"]))
        assert error.status == 503 and "being gathered" in error.message
        assert ARENA_MIB_ENV in error.message
        assert writer.space.reserved == 0 and len(capture.budget) == 0


def test_spans_sums_past_the_device_limit_are_a_413(ring: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring
    # 5 spans x 2 layers x 4 floats (160 bytes) and one layer's running sum of 11 rows (176)
    runner, capture = capture_of(writer, device_limit=300)
    args = {**xargs(K, pooling="spans", layers=LAYERS), SPANS_ENTRY: [0, 2] * 5}
    step(capture, runner, [("a", 10, 0, 4)], new={"a": args})
    error = error_of(reader.lookup(K))
    assert error.status == 413 and DEVICE_MIB_ENV in error.message
    assert len(capture.spans) == len(capture.device) == len(capture.budget) == 0


def test_answers_kept_rows_past_the_device_limit_are_a_503_then_fit_again(
    ring: tuple[RingWriter, RingReader],
) -> None:
    """Each all_answer choice keeps up to 8 (max_tokens) rows of 2 layers: 256 bytes counted.
    Two together are past a limit of 400: the second is a 503; once the first finished, a
    third fits."""
    writer, reader = ring
    runner, capture = capture_of(writer, device_limit=400)
    second, third = key(6), key(7)
    first_args = answer_args()
    second_args = {**first_args, **xargs(second, pooling="all_answer", layers=LAYERS)}
    step(capture, runner, [("a", 3, 0, 3), ("b", 3, 0, 3)], new={"a": first_args, "b": second_args})
    error = error_of(reader.lookup(second))
    assert error.status == 503 and DEVICE_MIB_ENV in error.message
    assert capture.device.reserved == 256
    step(capture, runner, [("a", 3, 3, 1)])
    step(capture, runner, [], finished=["a", "b"])
    assert record_of(reader.lookup(all_answer_key(K, 0))).rows == 2
    assert capture.device.reserved == 0 and writer.space.reserved == 0
    third_args = xargs(third, pooling="all_answer", layers=LAYERS)
    step(capture, runner, [("c", 3, 0, 3)], new={"c": third_args})
    step(capture, runner, [], finished=["c"])
    assert record_of(reader.lookup(all_answer_key(third, 0))).rows == 1


def test_last_answer_rows_past_the_device_limit_are_a_413(
    ring: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring
    runner, capture = capture_of(writer, device_limit=200)  # 9 positions x 2 layers: 288
    step(
        capture, runner, [("a", 3, 0, 3)], new={"a": xargs(K, pooling="last_answer", layers=LAYERS)}
    )
    error = error_of(reader.lookup(K))
    assert error.status == 413 and DEVICE_MIB_ENV in error.message
    assert len(capture.answers) == len(capture.device) == 0
