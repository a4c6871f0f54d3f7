"""The shared types (proxy/types.py): the JSON type checks the endpoints share, and the layers
wanted vectors capture."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hidden_state_proxy.proxy.types import VectorRequest, WantedVectors, is_int, is_token_ids


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


def test_the_layers_to_capture_are_ascending_and_each_once() -> None:
    wanted = WantedVectors(VectorRequest(layers=(4, 0, -1)), layers=(4, 0, 4), final_layer=4)
    assert wanted.distinct_layers == (0, 4)
