"""The answer's state (worker_hook/answer_rows.py, through capture.StepCapture): each choice's
latest sampling positions kept while it runs, published under answer keys when it finishes."""

from __future__ import annotations

import pytest
import torch

from tests.worker_hook.fakes import (
    CAPTURED,
    FINAL,
    MODEL,
    FakeV1Runner,
    error_of,
    key,
    record_of,
    row_vector,
    step,
    xargs,
)
from vllm_hidden_state_proxy.protocol import ANSWER_WINDOW, CHOICES_ENTRY, answer_key
from vllm_hidden_state_proxy.ring import RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook.answer_rows import choice_index, sampling_row
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView
from vllm_hidden_state_proxy.worker_hook.selection import ScheduledRequest

K = key(7)


def answer_args(choices: int = 1, layers: list[int] | None = None) -> dict[str, object]:
    args = xargs(K, pooling="last_answer", layers=layers)
    if choices > 1:
        args[CHOICES_ENTRY] = choices
    return args


def capture_of(writer: RingWriter) -> tuple[FakeV1Runner, StepCapture]:
    runner = FakeV1Runner(torch.float16)
    return runner, StepCapture(V1RunnerView(), writer, MODEL, captured=CAPTURED)


def assert_answer(reader: RingReader, choice: int, count: int, row: int, prompt: int) -> None:
    record = record_of(reader.lookup(answer_key(K, choice, count)))
    assert record.pooling == "last_answer"
    assert (record.position, record.num_prompt_tokens) == (prompt + count - 2, prompt)
    assert record.vector(FINAL) == row_vector(row)


def test_prefill_and_decode_steps_publish_each_kept_position_when_it_finishes(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = capture_of(writer)
    step(capture, runner, [("other", 3, 0, 3), ("a", 5, 0, 5)], new={"a": answer_args()})
    step(capture, runner, [("other", 3, 3, 1), ("a", 5, 5, 1)])  # decode: row 1
    step(capture, runner, [("a", 5, 6, 1)])  # decode: row 0
    assert writer.publish_count() == 0  # nothing until the answer finishes
    assert len(capture.answers) == 1
    step(capture, runner, [], finished=["a"])  # an empty step: published at once
    assert writer.publish_count() == 3
    assert_answer(reader, 0, 1, row=3 + 4, prompt=5)  # the last prompt position chose token 1
    assert_answer(reader, 0, 2, row=1, prompt=5)
    assert_answer(reader, 0, 3, row=0, prompt=5)
    assert len(capture.answers) == 0


def test_each_child_of_n_choices_publishes_its_own(writer: RingWriter, reader: RingReader) -> None:
    runner, capture = capture_of(writer)
    args = answer_args(choices=2)
    step(capture, runner, [("0_p", 4, 0, 4), ("1_p", 4, 0, 4)], new={"0_p": args, "1_p": args})
    step(capture, runner, [("0_p", 4, 4, 1), ("1_p", 4, 4, 1)])
    step(capture, runner, [("1_p", 4, 5, 1)], finished=["0_p"])  # a busy step
    step(capture, runner, [], finished=["1_p"])
    assert_answer(reader, 0, 1, row=3, prompt=4)
    assert_answer(reader, 1, 1, row=7, prompt=4)
    assert_answer(reader, 0, 2, row=0, prompt=4)
    assert_answer(reader, 1, 2, row=1, prompt=4)
    assert_answer(reader, 1, 3, row=0, prompt=4)
    assert reader.lookup(answer_key(K, 0, 3)) is None  # choice 0 never computed it


def test_a_chunked_prefill_keeps_only_the_last_chunks_sampling_row_and_a_window(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = capture_of(writer)
    step(capture, runner, [("a", 10, 0, 6)], new={"a": answer_args()})  # positions 0..5: none
    step(capture, runner, [("a", 10, 6, 4)])  # 6..9: the last prompt position, row 3
    decodes = ANSWER_WINDOW + 2
    for done in range(decodes):
        step(capture, runner, [("x", 2, 0, 2), ("a", 10, 10 + done, 1)])  # row 2 each time
    step(capture, runner, [], finished=["a"])
    assert writer.publish_count() == ANSWER_WINDOW
    last = decodes + 1  # the prompt's sampling position chose token 1, each decode one more
    assert all(
        reader.lookup(answer_key(K, 0, c)) is None for c in range(1, last - ANSWER_WINDOW + 1)
    )
    for count in range(last - ANSWER_WINDOW + 1, last + 1):
        assert_answer(reader, 0, count, row=2, prompt=10)


def test_a_recomputed_position_replaces_the_kept_one(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = capture_of(writer)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": answer_args()})  # position 2: row 2
    step(capture, runner, [("a", 3, 3, 1)])  # position 3: row 0
    step(capture, runner, [("x", 5, 0, 5), ("a", 3, 0, 4)])  # preempted: 0..3 again, row 8
    step(capture, runner, [], finished=["a"])
    assert_answer(reader, 0, 1, row=2, prompt=3)
    assert_answer(reader, 0, 2, row=5 + 3, prompt=3)


def test_what_cannot_be_answered_is_an_error_under_the_request_key(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = capture_of(writer)
    step(capture, runner, [("not-a-child", 3, 0, 3)], new={"not-a-child": answer_args(choices=2)})
    assert "child request" in error_of(reader.lookup(K)).message
    speculative_runner, speculative = capture_of(writer)
    speculative.speculative = True
    other = key(8)
    args = {**answer_args(), "hidden_state_proxy_key": other.hex()}
    step(speculative, speculative_runner, [("s", 3, 0, 3)], new={"s": args})
    assert "speculative decoding" in error_of(reader.lookup(other)).message
    assert len(capture.answers) == len(speculative.answers) == 0


def test_an_answer_aborted_before_its_prompt_completes_gets_an_error(
    writer: RingWriter, reader: RingReader
) -> None:
    runner, capture = capture_of(writer)
    step(capture, runner, [("a", 10, 0, 4)], new={"a": answer_args()})
    step(capture, runner, [], finished=["a"])
    assert "ended before" in error_of(reader.lookup(K)).message


def test_sampling_row_and_choice_index() -> None:
    def request(prompt: int, nc: int, ns: int) -> ScheduledRequest:
        return ScheduledRequest("r", 10, nc, ns, prompt)

    assert sampling_row(request(5, 0, 5)) == (4, 14)
    assert sampling_row(request(5, 0, 3)) is None  # a chunk before the last
    assert sampling_row(request(5, 7, 1)) == (7, 10)
    assert sampling_row(request(5, 7, 0)) is None
    assert [choice_index(r, 3) for r in ("0_x", "2_x_y", "3_x", "x", "_x")] == [
        0,
        2,
        None,
        None,
        None,
    ]
    assert choice_index("anything", 1) == 0


@pytest.mark.parametrize("choices", [0, -1, True, "2", 10**7])
def test_a_malformed_choice_count_is_an_error(
    writer: RingWriter, reader: RingReader, choices: object
) -> None:
    runner, capture = capture_of(writer)
    args = {**answer_args(), CHOICES_ENTRY: choices}
    step(capture, runner, [("a", 3, 0, 3)], new={"a": args})
    assert "choice count" in error_of(reader.lookup(K)).message


def test_a_request_resumed_as_new_keeps_its_rows(writer: RingWriter, reader: RingReader) -> None:
    """V2's scheduler sends a preempted request back as a new one: its kept rows stay."""
    runner, capture = capture_of(writer)
    step(capture, runner, [("a", 3, 0, 3)], new={"a": answer_args()})  # position 2: row 2
    step(capture, runner, [("a", 3, 3, 1)])  # position 3: row 0
    step(capture, runner, [("x", 2, 0, 2), ("a", 3, 0, 5)], new={"a": answer_args()})  # row 6
    step(capture, runner, [], finished=["a"])
    assert_answer(reader, 0, 1, row=2, prompt=3)
    assert_answer(reader, 0, 2, row=0, prompt=3)
    assert_answer(reader, 0, 3, row=2 + 4, prompt=3)
