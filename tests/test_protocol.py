"""protocol.py's helpers: the one layer-list parser and the one absolute-layer index."""

from __future__ import annotations

import pytest

from vllm_hidden_state_proxy.protocol import absolute_layer, layer_indices


@pytest.mark.parametrize(
    ("text", "layers"),
    [
        ("4,8,-1", (4, 8, -1)),
        (" 4 , 8 ", (4, 8)),
        ("-1", (-1,)),
        ("0,,2,", (0, 2)),
        ("8,4,8", (8, 4, 8)),  # as given: ordering and duplicates are the caller's
        ("0, 1, 2", (0, 1, 2)),  # the proxy's list of captured layers
        ("", ()),
        (" , ", ()),
        ("+3,-0", (3, 0)),
    ],
)
def test_layer_indices(text: str, layers: tuple[int, ...]) -> None:
    assert layer_indices(text) == layers


@pytest.mark.parametrize(
    ("text", "item"),
    [
        ("four", "four"),
        ("4, 1.5", "1.5"),
        ("1;2", "1;2"),
        ("0x2", "0x2"),
        ("2, x y ,3", "x y"),  # the item as given, stripped
        ("x,y", "x"),  # the first one
    ],
)
def test_layer_indices_names_the_first_item_that_is_not_one(text: str, item: str) -> None:
    with pytest.raises(ValueError) as raised:
        layer_indices(text)
    assert str(raised.value) == f"{item!r} is not a layer index (expected e.g. 4,8,-1)"


@pytest.mark.parametrize(
    ("layer", "final", "absolute"),
    [
        (0, 12, 0),
        (12, 12, 12),
        (-1, 12, 12),
        (-13, 12, 0),  # -N-1 is the embeddings
        (-2, 12, 11),
        (13, 12, None),
        (-14, 12, None),
        (1, 1, 1),
        (-2, 1, 0),
        (2, 1, None),
    ],
)
def test_absolute_layer(layer: int, final: int, absolute: int | None) -> None:
    assert absolute_layer(layer, final) == absolute
