"""selection.py: which rows hold a request's vectors, and which requests want what.

Pure logic: no vLLM, no torch. Batches are synthetic but follow vLLM's layout: a request's
``ns`` tokens of this step occupy rows ``query_start .. query_start + ns - 1`` and continue
after its ``nc`` already computed tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hidden_state_proxy.protocol import LAYERS_ENTRY, POOLING_ENTRY, REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.worker_hook.selection import (
    MeanGap,
    MeanRows,
    ScheduledRequest,
    SelectedRequests,
    Selection,
    last_prompt_row,
    mean_rows,
    request_key_of,
    selection_of,
)


def req(*, P: int, nc: int, ns: int, qs: int = 0, req_id: str = "r") -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id, query_start=qs, num_computed=nc, num_scheduled=ns, num_prompt_tokens=P
    )


def run_chunks(P: int, chunks: list[int], nc0: int = 0, qs: int = 0) -> list[int | None]:
    """last_prompt_row for each step of a request computed in ``chunks``, from ``nc0``."""
    rows: list[int | None] = []
    nc = nc0
    for ns in chunks:
        rows.append(last_prompt_row(req(P=P, nc=nc, ns=ns, qs=qs)))
        nc += ns
    return rows


# -- last_prompt_row -------------------------------------------------------------------------


@pytest.mark.parametrize("qs", [0, 1, 37])
def test_full_prefill_row_is_last_prompt_token(qs: int) -> None:
    assert last_prompt_row(req(P=7, nc=0, ns=7, qs=qs)) == qs + 6


def test_single_token_prompt() -> None:
    assert last_prompt_row(req(P=1, nc=0, ns=1, qs=5)) == 5


def test_chunked_prefill_last_token_in_last_chunk() -> None:
    # P=10 in chunks of 4, 4, 2: P-1=9 is the 2nd token of the last chunk.
    assert run_chunks(10, [4, 4, 2], qs=3) == [None, None, 3 + 1]


def test_chunked_prefill_last_token_at_chunk_boundary() -> None:
    # P=8 in chunks of 4, 4: P-1=7 is the last row of the second chunk, not the first row
    # of anything after it.
    assert run_chunks(8, [4, 4], qs=2) == [None, 2 + 3]
    # P=5 in chunks of 4, 1: P-1=4 is the only token of the last chunk.
    assert run_chunks(5, [4, 1], qs=9) == [None, 9]


def test_chunked_re_prefill_last_token_in_first_chunk() -> None:
    # Resumed after preemption: prompt (P=3) + 2 output tokens re-prefilled in chunks 4, 1.
    assert run_chunks(3, [4, 1], qs=6) == [6 + 2, None]


def test_chunked_re_prefill_last_token_in_middle_chunk() -> None:
    # P=6 plus 6 output tokens re-prefilled in chunks of 4: P-1=5 is row 1 of chunk 2.
    assert run_chunks(6, [4, 4, 4], qs=10) == [None, 10 + 1, None]


@pytest.mark.parametrize(
    ("P", "nc", "ns", "qs", "expected"),
    [
        (20, 16, 4, 0, 3),  # prefix cache hit of 16 tokens
        (20, 16, 4, 11, 14),
        (20, 19, 1, 7, 7),  # full hit: vLLM still recomputes the last prompt token
        (33, 16, 8, 0, None),  # hit, then the first chunk stops before P-1
        (33, 32, 1, 4, 4),  # second chunk after a hit, one token
    ],
)
def test_prefix_cache_offsets(P: int, nc: int, ns: int, qs: int, expected: int | None) -> None:
    assert last_prompt_row(req(P=P, nc=nc, ns=ns, qs=qs)) == expected


@pytest.mark.parametrize(
    ("nc", "ns"),
    [
        (5, 1),  # first decode step (nc == P)
        (9, 1),  # later decode step
        (5, 4),  # decode with 3 speculative tokens
        (12, 3),
    ],
)
def test_decode_steps_have_no_row(nc: int, ns: int) -> None:
    assert last_prompt_row(req(P=5, nc=nc, ns=ns, qs=8)) is None


@pytest.mark.parametrize(
    ("nc", "ns", "qs", "expected"),
    [
        (0, 8, 0, 4),  # P=5 + 3 outputs, everything recomputed
        (0, 8, 3, 7),
        (4, 4, 2, 2),  # prefix-cache hit of 4 on re-prefill: P-1 is the first row
        (2, 6, 0, 2),
        (5, 3, 0, None),  # hit covers the whole prompt: P-1 is not recomputed
    ],
)
def test_re_prefill_after_preemption(nc: int, ns: int, qs: int, expected: int | None) -> None:
    # Prompt + output tokens are scheduled; the row is still the one of position P-1.
    assert last_prompt_row(req(P=5, nc=nc, ns=ns, qs=qs)) == expected


def test_mixed_batch_rows_are_within_each_requests_segment() -> None:
    # Batch order: decode(1), full prefill(6), middle chunk(4), last chunk(3), hit(2), decode(1).
    batch = [
        req(req_id="dec", P=4, nc=9, ns=1),
        req(req_id="full", P=6, nc=0, ns=6),
        req(req_id="mid", P=20, nc=4, ns=4),
        req(req_id="last", P=11, nc=8, ns=3),
        req(req_id="hit", P=18, nc=16, ns=2),
        req(req_id="dec2", P=3, nc=3, ns=1),
    ]
    start = 0
    placed = []
    for r in batch:
        placed.append(
            ScheduledRequest(r.req_id, start, r.num_computed, r.num_scheduled, r.num_prompt_tokens)
        )
        start += r.num_scheduled
    rows = {r.req_id: last_prompt_row(r) for r in placed}
    assert rows == {
        "dec": None,
        "full": 1 + 5,
        "mid": None,
        "last": 11 + 2,
        "hit": 14 + 1,
        "dec2": None,
    }


@pytest.mark.parametrize(
    ("P", "nc", "ns"),
    [
        (0, 0, 0),
        (0, 0, 3),  # empty prompt
        (5, 0, 0),  # nothing scheduled
        (5, 4, 0),  # nothing scheduled, even though nc == P-1
        (5, 4, -1),
        (-1, 0, 1),
    ],
)
def test_zero_length_edges(P: int, nc: int, ns: int) -> None:
    assert last_prompt_row(req(P=P, nc=nc, ns=ns, qs=3)) is None


@settings(max_examples=300, deadline=None)
@given(
    P=st.integers(min_value=1, max_value=400),
    hit_fraction=st.floats(min_value=0.0, max_value=1.0),
    chunks=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=8),
    starts=st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=8),
    extra_steps=st.integers(min_value=0, max_value=4),
)
def test_property_exactly_one_row_at_absolute_position_p_minus_1(
    P: int,
    hit_fraction: float,
    chunks: list[int],
    starts: list[int],
    extra_steps: int,
) -> None:
    """Any chunking from any prefix-cache hit yields one row, and it is position P-1."""
    nc = min(int(hit_fraction * P), P - 1)  # a hit never covers the prompt's last token
    hits = []
    step = 0
    # Prefill chunks (they may run past P: a re-prefill covers prompt + output tokens),
    # then a few decode steps.
    while nc < P + extra_steps:
        ns = chunks[step % len(chunks)] if nc < P else 1
        qs = starts[step % len(starts)]
        row = last_prompt_row(req(P=P, nc=nc, ns=ns, qs=qs))
        if row is not None:
            assert qs <= row < qs + ns  # inside this request's segment
            hits.append(nc + (row - qs))  # absolute token position of that row
        nc += ns
        step += 1
    assert hits == [P - 1]


# -- mean_rows ------------------------------------------------------------------------------------


def test_mean_rows_of_a_full_prefill_are_the_prompt_rows() -> None:
    assert mean_rows(req(P=5, nc=0, ns=5, qs=7), 0) == MeanRows(7, 12, 5)


def test_mean_rows_over_chunks_continue_where_the_sum_stopped() -> None:
    covered = 0
    got = []
    for nc, ns, qs in ((0, 4, 3), (4, 4, 0), (8, 2, 9)):
        rows = mean_rows(req(P=10, nc=nc, ns=ns, qs=qs), covered)
        assert rows is not None
        got.append(rows)
        covered = rows.covered
    assert got == [MeanRows(3, 7, 4), MeanRows(0, 4, 8), MeanRows(9, 11, 10)]


def test_mean_rows_stop_at_the_prompt() -> None:
    # A re-prefill of prompt + 3 outputs: the output rows are not part of the mean.
    assert mean_rows(req(P=5, nc=0, ns=8, qs=2), 0) == MeanRows(2, 7, 5)
    assert mean_rows(req(P=5, nc=5, ns=1, qs=2), 5) is None  # a decode step adds nothing


@pytest.mark.parametrize(
    ("nc", "ns", "covered", "expected"),
    [
        (0, 12, 8, MeanRows(8 + 10, 12 + 10, 12)),  # re-prefill: positions 0..7 are skipped
        (0, 4, 8, None),  # a re-prefill chunk of positions already summed
        (4, 8, 8, MeanRows(4 + 10, 8 + 10, 12)),
        (8, 4, 8, MeanRows(10, 14, 12)),  # exactly where the sum stopped
    ],
)
def test_mean_rows_skip_recomputed_positions(
    nc: int, ns: int, covered: int, expected: MeanRows | None
) -> None:
    assert mean_rows(req(P=12, nc=nc, ns=ns, qs=10), covered) == expected


@pytest.mark.parametrize(
    ("nc", "covered", "gap"),
    [(4, 0, "positions 0..3"), (9, 8, "positions 8..8"), (12, 4, "positions 4..11")],
)
def test_mean_rows_past_the_sum_are_a_gap(nc: int, covered: int, gap: str) -> None:
    with pytest.raises(MeanGap, match=gap) as raised:
        mean_rows(req(P=16, nc=nc, ns=2), covered)
    assert "this pooling needs all 16 prompt positions" in str(raised.value)
    assert "cache_salt" in str(raised.value)


@settings(max_examples=300, deadline=None)
@given(
    P=st.integers(min_value=1, max_value=200),
    chunks=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=8),
    preempt_after=st.lists(st.integers(min_value=0, max_value=6), max_size=3),
    qs=st.integers(min_value=0, max_value=300),
)
def test_property_every_prompt_position_is_summed_exactly_once(
    P: int, chunks: list[int], preempt_after: list[int], qs: int
) -> None:
    """Any chunking, with preemptions that recompute from zero, sums positions 0..P-1 once."""
    summed: list[int] = []
    covered = 0
    nc = 0
    step = 0
    restarts = sorted(set(preempt_after))
    while covered < P:
        if restarts and step == restarts[0]:
            restarts.pop(0)
            nc = 0  # preempted: recomputed from the start (no prefix cache)
        ns = chunks[step % len(chunks)]
        rows = mean_rows(req(P=P, nc=nc, ns=ns, qs=qs), covered)
        if rows is not None:
            assert qs <= rows.first < rows.end <= qs + ns
            summed.extend(range(nc + rows.first - qs, nc + rows.end - qs))
            covered = rows.covered
        nc += ns
        step += 1
    assert summed == list(range(P))


# -- request_key_of / selection_of ----------------------------------------------------------------

KEY_A = bytes(range(1, 17))
KEY_B = bytes(range(101, 117))
KEY_C = bytes(range(201, 217))
CAPTURED = (0, 2, 4)
FINAL = 4


def params(extra_args: Any) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra_args)


def test_request_key_of_parses_the_wire_form() -> None:
    assert request_key_of(params({REQUEST_KEY_ENTRY: KEY_A.hex()})) == KEY_A
    assert request_key_of(params({REQUEST_KEY_ENTRY: KEY_A.hex().upper()})) == KEY_A
    assert request_key_of(params(None)) is None
    assert request_key_of(None) is None


def test_selection_defaults_to_the_last_position_of_the_final_layer() -> None:
    assert selection_of(params({REQUEST_KEY_ENTRY: KEY_A.hex()}), CAPTURED, FINAL) == Selection(
        KEY_A, (FINAL,), "last", None
    )
    assert selection_of(params({"other": 1}), CAPTURED, FINAL) is None
    assert selection_of(None, CAPTURED, FINAL) is None


@pytest.mark.parametrize(
    ("layers", "pooling", "expected"),
    [
        ([4, 0], "mean", ((0, 4), "mean")),  # sorted: records hold layers in ascending order
        ([2], "last", ((2,), "last")),
        ([0, 2, 4], None, ((0, 2, 4), "last")),
        (None, "mean", ((FINAL,), "mean")),
    ],
)
def test_selection_reads_layers_and_pooling(
    layers: list[int] | None, pooling: str | None, expected: tuple[tuple[int, ...], str]
) -> None:
    args: dict[str, Any] = {REQUEST_KEY_ENTRY: KEY_A.hex()}
    if layers is not None:
        args[LAYERS_ENTRY] = layers
    if pooling is not None:
        args[POOLING_ENTRY] = pooling
    selection = selection_of(params(args), CAPTURED, FINAL)
    assert selection == Selection(KEY_A, *expected)


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ({LAYERS_ENTRY: 4}, "malformed layer list 4"),
        ({LAYERS_ENTRY: "0,4"}, "malformed layer list '0,4'"),
        ({LAYERS_ENTRY: []}, "malformed layer list []"),
        ({LAYERS_ENTRY: [0, "2"]}, "malformed layer list [0, '2']"),
        ({LAYERS_ENTRY: [False]}, "malformed layer list [False]"),
        ({LAYERS_ENTRY: [4, 4]}, "malformed layer list [4, 4]"),
        ({LAYERS_ENTRY: [1, 3, 4]}, "layers [1, 3] are not captured by this vLLM engine"),
        ({LAYERS_ENTRY: [5]}, "(it captures 0, 2, 4; start it with them in HIDDEN_STATE_PROXY"),
        ({POOLING_ENTRY: "max"}, "unknown pooling 'max'"),
        ({POOLING_ENTRY: "MEAN"}, "unknown pooling 'MEAN'"),
        ({POOLING_ENTRY: None}, "unknown pooling None"),
    ],
)
def test_what_cannot_be_served_is_a_problem_not_a_drop(
    entries: dict[str, Any], problem: str
) -> None:
    selection = selection_of(params({REQUEST_KEY_ENTRY: KEY_A.hex(), **entries}), CAPTURED, FINAL)
    assert selection is not None
    assert selection.key == KEY_A
    assert selection.problem is not None and problem in selection.problem
    assert selection.layers == (FINAL,)


# -- SelectedRequests -----------------------------------------------------------------------------


def new_req(req_id: str, extra_args: Any = None, *, sampling: bool = True) -> SimpleNamespace:
    """The two attributes observe() reads of a vLLM NewRequestData."""
    sampling_params = params(extra_args) if sampling else None
    return SimpleNamespace(req_id=req_id, sampling_params=sampling_params)


def flagged(req_id: str, key: bytes, **entries: Any) -> SimpleNamespace:
    return new_req(req_id, {REQUEST_KEY_ENTRY: key.hex(), "other": 1, **entries})


def keys(selected: SelectedRequests) -> dict[str, bytes]:
    return {req_id: selection.key for req_id, selection in selected.pending.items()}


def test_observe_selects_only_well_formed_keys() -> None:
    selected = SelectedRequests(CAPTURED, FINAL)
    selected.observe(
        [
            flagged("good", KEY_A),
            new_req("short", {REQUEST_KEY_ENTRY: KEY_B.hex()[:-2]}),
            new_req("long", {REQUEST_KEY_ENTRY: KEY_B.hex() + "00"}),
            new_req("nonhex", {REQUEST_KEY_ENTRY: "zz" * 16}),
            new_req("int", {REQUEST_KEY_ENTRY: 12345}),
            new_req("raw-bytes", {REQUEST_KEY_ENTRY: KEY_B}),
            new_req("none-value", {REQUEST_KEY_ENTRY: None}),
            new_req("list-args", [REQUEST_KEY_ENTRY, KEY_B.hex()]),
            new_req("other-keys", {"something": KEY_B.hex()}),
            new_req("empty-args", {}),
            new_req("no-args", None),
            new_req("pooling", sampling=False),  # pooling requests: sampling_params is None
            SimpleNamespace(req_id="no-attr"),  # no sampling_params attribute at all
            flagged("good2", KEY_B, **{LAYERS_ENTRY: [0, 2], POOLING_ENTRY: "mean"}),
        ],
        finished_req_ids=set(),
    )
    assert selected.pending == {
        "good": Selection(KEY_A, (FINAL,)),
        "good2": Selection(KEY_B, (0, 2), "mean"),
    }


def test_a_request_with_a_problem_is_selected_to_be_answered() -> None:
    selected = SelectedRequests(CAPTURED, FINAL)
    selected.observe([flagged("bad", KEY_A, **{LAYERS_ENTRY: [1]})], finished_req_ids=())
    problem = selected.pending["bad"].problem
    assert problem is not None and "not captured" in problem


@pytest.mark.parametrize("value", ["ab" * 15 + "  ", "ab " * 10 + "ab"])
def test_observe_ignores_whitespace_padded_key(value: str) -> None:
    assert len(value) == 32
    selected = SelectedRequests()
    selected.observe([new_req("ws", {REQUEST_KEY_ENTRY: value})], finished_req_ids=())
    assert selected.pending == {}


def test_default_selection_is_the_final_layer_of_a_final_layer_only_engine() -> None:
    selected = SelectedRequests()  # captures layer 1 of a 1-layer model, as StepCapture's default
    selected.observe([flagged("a", KEY_A)], finished_req_ids=())
    assert selected.pending == {"a": Selection(KEY_A, (1,))}


def test_observe_forgets_finished_requests() -> None:
    selected = SelectedRequests()
    selected.observe([flagged("a", KEY_A), flagged("b", KEY_B)], finished_req_ids=())
    selected.observe([], finished_req_ids={"a", "never-seen"})
    assert keys(selected) == {"b": KEY_B}
    selected.observe([flagged("c", KEY_C)], finished_req_ids=["b"])
    assert keys(selected) == {"c": KEY_C}


def test_observe_keeps_a_request_id_that_is_finished_and_new_in_the_same_step() -> None:
    selected = SelectedRequests()
    selected.observe([flagged("reused", KEY_A)], finished_req_ids=())
    selected.observe([flagged("reused", KEY_B)], finished_req_ids={"reused"})
    assert keys(selected) == {"reused": KEY_B}


def test_publishes_once_per_key() -> None:
    selected = SelectedRequests()
    selected.observe([flagged("a", KEY_A), flagged("b", KEY_B)], finished_req_ids=())
    selected.mark_published("a", KEY_A)
    assert keys(selected) == {"b": KEY_B}
    # The same key seen again (V2 re-sends a preempted request as new; a late n>1 child)
    # is not selected again.
    selected.observe([flagged("a", KEY_A), flagged("a-child", KEY_A)], finished_req_ids=())
    assert keys(selected) == {"b": KEY_B}


def test_n_siblings_sharing_a_key_publish_once() -> None:
    selected = SelectedRequests()
    selected.observe(
        [flagged("0_parent", KEY_A), flagged("1_parent", KEY_A), flagged("x", KEY_B)],
        finished_req_ids=(),
    )
    assert keys(selected) == {"0_parent": KEY_A, "1_parent": KEY_A, "x": KEY_B}
    assert selected.has_sibling("0_parent", KEY_A)
    assert selected.has_sibling("1_parent", KEY_A)
    assert not selected.has_sibling("x", KEY_B)
    assert not selected.has_sibling("unknown", KEY_C)
    selected.mark_published("1_parent", KEY_A)
    assert keys(selected) == {"x": KEY_B}
    assert not selected.has_sibling("0_parent", KEY_A)


def test_a_dropped_sibling_leaves_the_key_to_the_others() -> None:
    selected = SelectedRequests()
    selected.observe(
        [flagged("0_p", KEY_A), flagged("1_p", KEY_A), flagged("2_p", KEY_A)], finished_req_ids=()
    )
    selected.drop(["1_p"])
    assert keys(selected) == {"0_p": KEY_A, "2_p": KEY_A}
    assert selected.has_sibling("0_p", KEY_A)
    selected.drop(["2_p"])
    assert not selected.has_sibling("0_p", KEY_A)


def test_published_keys_memory_is_bounded() -> None:
    selected = SelectedRequests(remember_published=2)
    for rid, key in (("a", KEY_A), ("b", KEY_B), ("c", KEY_C)):
        selected.observe([flagged(rid, key)], finished_req_ids=())
        selected.mark_published(rid, key)
    assert len(selected._published) == 2
    assert list(selected._published) == [KEY_B, KEY_C]
    # The oldest key was forgotten, so it can be selected again; the recent ones cannot.
    selected.observe(
        [flagged("a2", KEY_A), flagged("b2", KEY_B), flagged("c2", KEY_C)], finished_req_ids=()
    )
    assert keys(selected) == {"a2": KEY_A}


def test_drop_forgets_requests() -> None:
    selected = SelectedRequests()
    selected.observe([flagged("a", KEY_A), flagged("b", KEY_B)], finished_req_ids=())
    selected.drop(["a", "unknown"])
    assert keys(selected) == {"b": KEY_B}
    # Dropping is not publishing: the key may be selected again by a new request.
    selected.observe([flagged("a2", KEY_A)], finished_req_ids=())
    assert keys(selected) == {"b": KEY_B, "a2": KEY_A}
