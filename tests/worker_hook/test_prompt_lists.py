"""A flagged completions prompt list sent as one request (worker_hook/selection.py): each
prompt's engine request id is parsed exactly as vLLM 0.32 forms it, and its selection is keyed
by the prompt's own key; whatever does not parse or check is an error, never another prompt's
key."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hidden_state_proxy.protocol import (
    CHOICES_ENTRY,
    LIST_BASE_ENTRY,
    LIST_CHECKSUMS_ENTRY,
    LIST_FORM_ENTRY,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    REQUEST_KEY_ENTRY,
    prompt_key,
    token_ids_checksum,
)
from vllm_hidden_state_proxy.worker_hook.selection import (
    PromptList,
    SelectedRequests,
    ids_randomized,
    prompt_index,
    prompt_list_of,
)

KEY = bytes(range(16))
BASE = "0123456789abcdef" * 2
LIST = PromptList(BASE, 12)
PAIRS = PromptList(BASE, 12, choices=2)
CHATS = PromptList(BASE, 12, form="chatcmpl")


@pytest.mark.parametrize(
    ("req_id", "listed", "randomized", "expected"),
    [
        (f"cmpl-{BASE}-0-deadbeef", LIST, True, 0),
        (f"cmpl-{BASE}-11-0a1b2c3d", LIST, True, 11),
        (f"cmpl-{BASE}-3", LIST, False, 3),
        (f"1_cmpl-{BASE}-7-deadbeef", PAIRS, True, 7),
        (f"0_cmpl-{BASE}-7", PAIRS, False, 7),
        (f"chatcmpl-{BASE}_11-0a1b2c3d", CHATS, True, 11),
        (f"chatcmpl-{BASE}_0", CHATS, False, 0),
    ],
)
def test_the_index_of_an_id_as_vllm_forms_it(
    req_id: str, listed: PromptList, randomized: bool, expected: int
) -> None:
    assert prompt_index(req_id, listed, randomized) == expected


@pytest.mark.parametrize(
    "req_id",
    [
        f"cmpl-{BASE}-12-deadbeef",  # past the list
        f"cmpl-{BASE}-01-deadbeef",  # not how f"{i}" writes 1
        f"cmpl-{BASE}--1-deadbeef",
        f"cmpl-{BASE}-1-deadbee",  # suffix too short
        f"cmpl-{BASE}-1-deadbeef0",  # too long
        f"cmpl-{BASE}-1-DEADBEEF",  # random_uuid() is lowercase
        f"cmpl-{BASE}-1",  # no suffix, though vLLM adds one
        f"cmpl-{BASE}-1-dead-eef",
        f"cmpl-{BASE}-\u0663-deadbeef",  # an Arabic-Indic three: isdigit(), not vLLM's
        f"cmpl-{BASE}-\u00b2-deadbeef",  # superscript two
        f"cmpl-{BASE}-1_0-deadbeef",
        f"cmpl-{BASE[:-1]}-1-deadbeef",  # another base
        f"cmpl-{BASE}0-1-deadbeef",
        f"cmpl-x-5-deadbeef-{BASE}-1-deadbeef",
        f"chatcmpl-{BASE}-1-deadbeef",
        f"1_cmpl-{BASE}-1-deadbeef",  # a choice prefix where n = 1
        f"{BASE}-1-deadbeef",
        "x-5-deadbeef",
        "3_y",
        "",
        "é" * 10_000,
        f"cmpl-{BASE}-" + "1" * 10_000 + "-deadbeef",
    ],
)
def test_ids_not_formed_as_vllm_forms_them_have_no_index(req_id: str) -> None:
    assert prompt_index(req_id, LIST, randomized=True) is None


@pytest.mark.parametrize(
    "req_id",
    [
        f"cmpl-{BASE}-7-deadbeef",  # no choice prefix where n = 2
        f"2_cmpl-{BASE}-7-deadbeef",  # choice past n
        f"01_cmpl-{BASE}-7-deadbeef",
        f"_cmpl-{BASE}-7-deadbeef",
        f"1_1_cmpl-{BASE}-7-deadbeef",
        f"\u0661_cmpl-{BASE}-7-deadbeef",
    ],
)
def test_choice_prefixes_are_exact(req_id: str) -> None:
    assert prompt_index(req_id, PAIRS, randomized=True) is None


@pytest.mark.parametrize(
    "req_id",
    [
        f"chatcmpl-{BASE}-1-deadbeef",  # a completions prompt's form
        f"cmpl-{BASE}_1-deadbeef",
        f"chatcmpl-{BASE}_12-deadbeef",
        f"chatcmpl-{BASE}_1_2-deadbeef",
        f"0_chatcmpl-{BASE}_1-deadbeef",
        f"chatcmpl-{BASE}_01-deadbeef",
    ],
)
def test_a_chat_batchs_ids_are_exact(req_id: str) -> None:
    assert prompt_index(req_id, CHATS, randomized=True) is None
    assert prompt_index(f"cmpl-{BASE}-1-deadbeef", CHATS, randomized=True) is None


def test_without_randomization_a_suffix_is_refused() -> None:
    assert prompt_index(f"cmpl-{BASE}-1-deadbeef", LIST, randomized=False) is None


@given(st.text(max_size=200))
def test_any_text_parses_only_as_its_own_index(text: str) -> None:
    for randomized in (True, False):
        index = prompt_index(text, PAIRS, randomized)
        if index is not None:
            assert text.split("_", 1)[1].startswith(f"cmpl-{BASE}-{index}")


def test_ids_randomized_reads_vllms_variable() -> None:
    assert ids_randomized({}) is True
    assert ids_randomized({"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "0"}) is True
    assert ids_randomized({"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}) is False
    assert ids_randomized({"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "yes"}) is True


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ({}, None),
        ({LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 3}, PromptList(BASE, 3)),
        (
            {
                LIST_BASE_ENTRY: BASE,
                LIST_SIZE_ENTRY: 2,
                LIST_TOKENS_ENTRY: [1, 2],
                LIST_CHECKSUMS_ENTRY: [5, 6],
            },
            PromptList(BASE, 2, 1, (1, 2), (5, 6)),
        ),
        ({LIST_BASE_ENTRY: BASE}, "malformed prompt list size"),
        ({LIST_SIZE_ENTRY: 3}, "malformed prompt list base"),
        ({LIST_BASE_ENTRY: "x-5", LIST_SIZE_ENTRY: 3}, "malformed prompt list base"),
        ({LIST_BASE_ENTRY: BASE.upper(), LIST_SIZE_ENTRY: 3}, "malformed prompt list base"),
        ({LIST_BASE_ENTRY: "a" * 65, LIST_SIZE_ENTRY: 3}, "malformed prompt list base"),
        ({LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 0}, "malformed prompt list size"),
        (
            {LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 3, LIST_FORM_ENTRY: "chatcmpl"},
            PromptList(BASE, 3, form="chatcmpl"),
        ),
        (
            {LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 3, LIST_FORM_ENTRY: "embd"},
            "malformed prompt list form",
        ),
        ({LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: True}, "malformed prompt list size"),
        ({LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: "3"}, "malformed prompt list size"),
        (
            {LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 2, LIST_TOKENS_ENTRY: [1, 2]},
            "malformed prompt list checks",
        ),
        (
            {
                LIST_BASE_ENTRY: BASE,
                LIST_SIZE_ENTRY: 2,
                LIST_TOKENS_ENTRY: [1],
                LIST_CHECKSUMS_ENTRY: [5, 6],
            },
            "malformed prompt list checks",
        ),
        (
            {
                LIST_BASE_ENTRY: BASE,
                LIST_SIZE_ENTRY: 1,
                LIST_TOKENS_ENTRY: [-1],
                LIST_CHECKSUMS_ENTRY: [5],
            },
            "malformed prompt list checks",
        ),
    ],
)
def test_the_list_marker(entries: dict[str, Any], expected: PromptList | str | None) -> None:
    assert prompt_list_of(entries, 1) == expected


def listed_request(req_id: str, size: int, prompt: Any = None, **entries: Any) -> SimpleNamespace:
    extra_args = {REQUEST_KEY_ENTRY: KEY.hex(), LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: size}
    return SimpleNamespace(
        req_id=req_id,
        sampling_params=SimpleNamespace(extra_args={**extra_args, **entries}),
        prompt_token_ids=prompt,
    )


def test_each_prompt_is_selected_under_its_own_key() -> None:
    selected = SelectedRequests()
    selected.observe(
        [listed_request(f"cmpl-{BASE}-{i}-0000000{i}", 3) for i in (2, 0, 1)],
        finished_req_ids=(),
    )
    assert {rid: s.key for rid, s in selected.pending.items()} == {
        f"cmpl-{BASE}-{i}-0000000{i}": prompt_key(KEY, i) for i in (2, 0, 1)
    }
    assert all(s.problem is None for s in selected.pending.values())
    assert len({prompt_key(KEY, i) for i in range(1000)} | {KEY}) == 1001


def test_children_of_a_prompt_share_its_key() -> None:
    selected = SelectedRequests(randomized_ids=False)
    selected.observe(
        [
            listed_request(f"{c}_cmpl-{BASE}-{i}", 2, **{CHOICES_ENTRY: 2})
            for i in range(2)
            for c in range(2)
        ],
        finished_req_ids=(),
    )
    assert {rid: s.key for rid, s in selected.pending.items()} == {
        f"{c}_cmpl-{BASE}-{i}": prompt_key(KEY, i) for i in range(2) for c in range(2)
    }
    assert selected.has_sibling(f"0_cmpl-{BASE}-1", prompt_key(KEY, 1))


def checks(*prompts: list[int]) -> dict[str, Any]:
    return {
        LIST_TOKENS_ENTRY: [len(p) for p in prompts],
        LIST_CHECKSUMS_ENTRY: [token_ids_checksum(p) for p in prompts],
    }


def test_token_ids_are_checked() -> None:
    sent = checks([1, 2, 3], [4, 5], [6])
    selected = SelectedRequests()
    selected.observe(
        [
            listed_request(f"cmpl-{BASE}-0-aaaaaaaa", 3, [1, 2, 3], **sent),
            listed_request(f"cmpl-{BASE}-1-aaaaaaaa", 3, [4, 5, 9], **sent),  # one more
            listed_request(f"cmpl-{BASE}-2-aaaaaaaa", 3, [7], **sent),  # another token
        ],
        finished_req_ids=(),
    )
    problems = {rid[-11:-8]: s.problem for rid, s in selected.pending.items()}
    keys = {rid[-11:-8]: s.key for rid, s in selected.pending.items()}
    assert problems["-0-"] is None
    assert "has 3 tokens in vLLM, not the 2 sent" in str(problems["-1-"])
    assert "other token ids" in str(problems["-2-"])
    assert keys == {f"-{i}-": prompt_key(KEY, i) for i in range(3)}  # errors under own keys


def test_a_prompt_without_token_ids_in_vllm_fails_its_check() -> None:
    selected = SelectedRequests()
    selected.observe(
        [listed_request(f"cmpl-{BASE}-0-aaaaaaaa", 1, None, **checks([1]))], finished_req_ids=()
    )
    assert "no token ids" in str(selected.pending[f"cmpl-{BASE}-0-aaaaaaaa"].problem)


@pytest.mark.parametrize("req_id", ["x-5-deadbeef", "3_y", f"cmpl-{BASE}-5-deadbeef", "é" * 10_000])
def test_an_id_that_does_not_parse_is_an_error_under_the_lists_key(req_id: str) -> None:
    selected = SelectedRequests()
    selected.observe([listed_request(req_id, 3)], finished_req_ids=())
    selection = selected.pending[req_id]
    assert selection.key == KEY  # the proxy looks for errors under it for every prompt
    assert selection.problem is not None and "is not a prompt of the list" in selection.problem
    assert len(selection.problem) < 400


def test_a_malformed_marker_is_an_error_under_the_lists_key() -> None:
    selected = SelectedRequests()
    request = listed_request(f"cmpl-{BASE}-0-aaaaaaaa", 1, **{LIST_SIZE_ENTRY: "1"})
    selected.observe([request], finished_req_ids=())
    assert selected.pending[request.req_id].key == KEY
    assert selected.pending[request.req_id].problem == "malformed prompt list size"


def test_a_request_that_raises_costs_no_other_its_selection() -> None:
    class Exploding:
        @property
        def req_id(self) -> str:
            raise RuntimeError("boom")

        sampling_params = SimpleNamespace(
            extra_args={REQUEST_KEY_ENTRY: KEY.hex(), LIST_BASE_ENTRY: BASE, LIST_SIZE_ENTRY: 1}
        )

    selected = SelectedRequests()
    selected.observe(
        [Exploding(), listed_request(f"cmpl-{BASE}-0-aaaaaaaa", 1)], finished_req_ids=()
    )
    assert list(selected.pending) == [f"cmpl-{BASE}-0-aaaaaaaa"]


def test_checksum_depends_on_every_id_and_the_order() -> None:
    ids = list(range(10_000))
    assert token_ids_checksum(ids) != token_ids_checksum(ids[:-1])
    assert token_ids_checksum([1, 2]) != token_ids_checksum([2, 1])
    assert token_ids_checksum([]) == 0
    assert token_ids_checksum([2**70]) == token_ids_checksum([2**70 % 2**64])
