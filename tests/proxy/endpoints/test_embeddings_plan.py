"""Planning an embeddings request (proxy/embeddings_plan.py): validation (a 400 naming the field),
the vLLM requests per input, the layer and pooling. Pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hidden_state_proxy.protocol import CHAT_PATH, COMPLETIONS_PATH, DEFAULT_TEMPLATE
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    FORWARDED_FIELDS,
    EmbeddingsDefaults,
    EmbeddingsPlan,
    dimensions_error,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.request_fields import VectorRequest

DEFAULTS = EmbeddingsDefaults(template=DEFAULT_TEMPLATE, max_inputs=10)


def plan(document: dict[str, Any], defaults: EmbeddingsDefaults = DEFAULTS) -> EmbeddingsPlan:
    return plan_embeddings(document, defaults)


def test_texts_become_templated_one_token_chat_requests_without_thinking() -> None:
    result = plan({"model": "m", "input": ["a", "b"]})
    assert [path for path, _ in result.calls] == [CHAT_PATH, CHAT_PATH]
    _, body = result.calls[1]
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": DEFAULT_TEMPLATE.replace("{text}", "b")}],
        "max_completion_tokens": 1,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert (result.encoding_format, result.normalize, result.dimensions) == ("float", True, None)
    assert result.field == "input"
    assert result.vectors == VectorRequest(layers=(-1,), pooling="last")


def test_a_single_text_is_one_call() -> None:
    assert len(plan({"input": "x"}).calls) == 1


def test_the_instruction_replaces_the_template() -> None:
    result = plan({"input": "x", "instruction": "query: {text}"})
    assert result.calls[0][1]["messages"][0]["content"] == "query: x"


def test_the_servers_template_is_used() -> None:
    defaults = EmbeddingsDefaults(template="Embed: {text}!", max_inputs=4)
    result = plan({"input": "x"}, defaults)
    assert result.calls[0][1]["messages"][0]["content"] == "Embed: x!"


def test_token_ids_skip_the_template() -> None:
    assert plan({"input": [1, 2, 3], "model": "m"}).calls == [
        (COMPLETIONS_PATH, {"prompt": [1, 2, 3], "max_tokens": 1, "model": "m"})
    ]
    assert [c[1]["prompt"] for c in plan({"input": [[1], [2, 3]]}).calls] == [[1], [2, 3]]


def test_the_messages_form_defaults_to_no_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    result = plan({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert result.field == "messages"
    assert result.calls == [
        (
            CHAT_PATH,
            {
                "messages": messages,
                "max_completion_tokens": 1,
                "add_generation_prompt": False,
                "continue_final_message": False,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
    ]
    prefill = plan({"messages": messages, "continue_final_message": True})
    assert prefill.calls[0][1]["continue_final_message"] is True
    assert "chat_template_kwargs" not in prefill.calls[0][1]


@pytest.mark.parametrize(
    "document",
    [
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": True,
            "continue_final_message": False,
            "chat_template_kwargs": {"enable_thinking": True},
        },
        {"model": "m", "input": "x"},
        {"model": "m", "input": [1, 2]},
    ],
    ids=["messages", "text", "token-ids"],
)
def test_forwarded_fields_are_the_clients_fields_the_calls_carry_as_written(
    document: dict[str, Any],
) -> None:
    """vLLM's error ``param`` is kept only for these (endpoints/embeddings.input_error)."""
    result = plan(document)
    ((_, body),) = result.calls
    as_written = {name for name, value in body.items() if document.get(name) == value}
    assert as_written == FORWARDED_FIELDS[result.field]


def test_formats_normalisation_and_dimensions() -> None:
    result = plan({"input": "x", "encoding_format": "base64", "normalize": False, "dimensions": 8})
    assert (result.encoding_format, result.normalize, result.dimensions) == ("base64", False, 8)
    nulls = plan({"input": "x", "encoding_format": None, "normalize": None})
    assert (nulls.encoding_format, nulls.normalize) == ("float", True)


# ---------------------------------------------------------------------------------------------
# layer and pooling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "layers", "pooling"),
    [
        ({}, (-1,), "last"),
        ({"layer": 2}, (2,), "last"),
        ({"layer": -3, "pooling": "mean"}, (-3,), "mean"),
        ({"layer": None, "pooling": None}, (-1,), "last"),
        ({"layer": 0}, (0,), "last"),
    ],
)
def test_layer_and_pooling_from_the_request(
    document: dict[str, Any], layers: tuple[int, ...], pooling: str
) -> None:
    assert plan({"input": "x", **document}).vectors == VectorRequest(layers=layers, pooling=pooling)


def test_layer_and_pooling_default_to_the_servers() -> None:
    defaults = EmbeddingsDefaults(DEFAULT_TEMPLATE, 10, layer=2, pooling="mean")
    assert plan({"input": "x"}, defaults).vectors == VectorRequest(layers=(2,), pooling="mean")
    asked = plan({"input": "x", "layer": 0, "pooling": "last"}, defaults)
    assert asked.vectors == VectorRequest(layers=(0,), pooling="last")


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({"input": [[1], [True]]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": {"a": 1}}, "input"),
        ({"input": ["x"] * 11}, "input"),
        ({"input": [[1]] * 11}, "input"),
        ({}, "input"),
        ({"input": "a", "messages": []}, "input"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "normalize": "yes"}, "normalize"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "dimensions": True}, "dimensions"),
        ({"input": "a", "instruction": "no placeholder"}, "instruction"),
        ({"input": "a", "instruction": 5}, "instruction"),
        ({"input": [1, 2], "instruction": "q: {text}"}, "instruction"),
        ({"messages": [{"role": "user"}], "instruction": "q: {text}"}, "instruction"),
        ({"input": "a", "model": 3}, "model"),
        ({"messages": [{"role": "user"}], "add_generation_prompt": 1}, "add_generation_prompt"),
        (
            {"messages": [{"role": "user"}], "continue_final_message": "no"},
            "continue_final_message",
        ),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"input": "a", "layer": "2"}, "layer"),
        ({"input": "a", "layer": 2.0}, "layer"),
        ({"input": "a", "layer": True}, "layer"),
        ({"input": "a", "layer": [2]}, "layer"),
        ({"input": "a", "pooling": "max"}, "pooling"),
        ({"input": "a", "pooling": 1}, "pooling"),
    ],
)
def test_bad_requests_name_their_field(document: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        plan(document)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_the_limit_on_inputs_is_named() -> None:
    with pytest.raises(ProxyError, match="'input' has 11 items; this server takes at most 10"):
        plan({"input": ["x"] * 11})


def test_dimensions_error_names_the_hidden_size() -> None:
    error = dimensions_error(4, 4096)
    assert (error.status, error.param) == (400, "dimensions")
    assert "4096 values" in error.message and "Matryoshka" in error.message
