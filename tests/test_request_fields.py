"""The JSON type checks of request_fields.py that the proxy's endpoints share too."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hidden_state_proxy.request_fields import is_int, is_token_ids


@pytest.mark.parametrize(
    ("value", "expected"), [(0, True), (-3, True), (True, False), (1.0, False), ("1", False)]
)
def test_a_json_integer_is_an_int_but_not_a_bool(value: Any, expected: bool) -> None:
    assert is_int(value) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [([1, 2], True), ([0], True), ([], False), ([1, True], False), ([1.5], False), ("12", False)],
)
def test_token_ids_are_a_non_empty_list_of_integers(value: Any, expected: bool) -> None:
    assert is_token_ids(value) is expected
