"""The fields a flagged request is planned with are read exactly as vLLM's own models read them
(issue #36, item 4): checked against vLLM's pydantic models themselves, value by value."""

from __future__ import annotations

import warnings
from typing import Annotated, Any

import orjson
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from vllm_hidden_state_proxy.protocol import CHOICES_ENTRY
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import Flagged, inspect_body
from vllm_hidden_state_proxy.proxy.planned_fields import (
    CHAT_FIELDS,
    COMPLETIONS_FIELDS,
    RESPONSES_FIELDS,
    PlannedFields,
    read_planned_fields,
)
from vllm_hidden_state_proxy.proxy.vectors.answers import answer_asks, check_answerable

ENDPOINTS: dict[str, tuple[PlannedFields, type[BaseModel], dict[str, Any]]] = {
    "chat": (CHAT_FIELDS, ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}]}),
    "completions": (COMPLETIONS_FIELDS, CompletionRequest, {"prompt": "a"}),
    "responses": (RESPONSES_FIELDS, ResponsesRequest, {"input": "a"}),
}

#: What clients send for numbers and booleans (JSON values as Python's json reads them).
SCALARS: list[Any] = [
    *(2, "2", " 2 ", 2.0, "2.0", "+2", "2_0", 2.5, "1e1", "0x2", -1, 10**20, 1e300),
    *(True, False, 1, 0, 1.0, 0.0, "1", "0", "true", "True", "yes", "on", "t", "y"),
    *("false", "off", "no", "n", " true", "maybe", None, [2], {"a": 1}, ""),
]
PROMPTS: list[Any] = [
    *("a", ["a", "b"], [1, 2], [1.0, 2.0], ["1", 2], [[1], [2.0]], [-1], [True, 2], 5, ["a", 1]),
    *([1.5], [[1], "a"], [], [[]]),
]


def vllm_type(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    field = model.model_fields[name]
    annotation: Any = field.annotation
    return TypeAdapter(Annotated[(annotation, *field.metadata)] if field.metadata else annotation)


def outcome(adapter: TypeAdapter[Any], value: Any) -> tuple[str, Any]:
    try:
        read = adapter.validate_python(value)
    except ValidationError:
        return ("refused", None)
    return ("read", (type(read), read))


CASES = [
    (endpoint, name, value)
    for endpoint, (fields, _, _) in ENDPOINTS.items()
    for name in fields.types
    for value in (PROMPTS if name == "prompt" else SCALARS)
]


@pytest.mark.parametrize(("endpoint", "name", "value"), CASES)
def test_each_planned_field_is_read_as_vllms_model_reads_it(
    endpoint: str, name: str, value: Any
) -> None:
    fields, model, base = ENDPOINTS[endpoint]
    expected = outcome(vllm_type(model, name), value)
    document = {**base, name: value}
    try:
        read = read_planned_fields(document, fields)
    except ProxyError as error:
        assert expected[0] == "refused", (value, expected)
        assert error.status == 400 and error.param == name
        assert repr(value)[:20] in error.message or len(repr(value)) > 40
        return
    if name == "prompt" and read[name] is value and expected[0] == "refused":
        return  # token ids as written (a negative one): vLLM refuses them itself
    assert expected == ("read", (type(read[name]), read[name]))
    try:  # what vLLM's whole model makes of it (its own checks may refuse more, never less)
        request = model.model_validate(document)
    except ValidationError:
        return
    if value is not None:  # vLLM puts its default in for some nulls
        with warnings.catch_warnings():  # vLLM's chat max_tokens is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            assert getattr(request, name) == read[name]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("value", [*SCALARS[:14], "yes", "maybe", None])
def test_stream_options_are_read_as_vllm_reads_them(endpoint: str, value: Any) -> None:
    fields, model, base = ENDPOINTS[endpoint]
    options = {"include_usage": value, "continuous_usage_stats": True, "other": "x"}
    document = {**base, "stream": True, "stream_options": options}
    try:
        request = model.model_validate(document)
    except ValidationError:
        with pytest.raises(ProxyError) as caught:
            read_planned_fields(document, fields)
        assert caught.value.param == "stream_options.include_usage"
        return
    read = read_planned_fields(document, fields)["stream_options"]
    options_read: Any = getattr(request, "stream_options")  # noqa: B009 (any of the models)
    assert read["include_usage"] is options_read.include_usage
    assert read["other"] == "x"  # the rest as the client wrote it


def test_every_planned_field_is_a_field_of_vllms_model() -> None:
    for fields, model, _ in ENDPOINTS.values():
        assert set(fields.types) <= set(model.model_fields)


def test_untouched_documents_are_not_copied() -> None:
    document = {"messages": [], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    assert read_planned_fields(document, CHAT_FIELDS) is document


FLAG = {"kv_transfer_params": {"return_last_hidden_state": True}}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"n": "2"}, {"n": 2}),
        ({"n": 2.0}, {"n": 2}),
        ({"echo": 1, "return_token_ids": "true"}, {"echo": True, "return_token_ids": True}),
        (
            {"stream": "yes", "stream_options": {"include_usage": 1}},
            {"stream": True, "stream_options": {"include_usage": True}},
        ),
        ({"max_tokens": "3"}, {"max_tokens": 3}),
    ],
)
def test_a_flagged_body_goes_on_as_vllm_reads_it(
    extra: dict[str, Any], expected: dict[str, Any]
) -> None:
    decision = inspect_body(orjson.dumps({**FLAG, "messages": [], **extra}))
    assert isinstance(decision, Flagged)
    for name, value in expected.items():
        assert decision.document[name] == value and type(decision.document[name]) is type(value)


@pytest.mark.parametrize("value", [True, 1, "true", "yes", 1.0])
def test_beam_search_with_the_flag_is_refused_before_sending(value: Any) -> None:
    with pytest.raises(ProxyError) as caught:
        inspect_body(orjson.dumps({**FLAG, "messages": [], "use_beam_search": value}))
    assert caught.value.status == 400 and caught.value.param == "use_beam_search"


@pytest.mark.parametrize(
    ("name", "value"), [("n", "two"), ("n", 2.5), ("stream", 2), ("echo", "x")]
)
def test_a_value_vllm_refuses_is_a_400_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ProxyError) as caught:
        inspect_body(orjson.dumps({**FLAG, "messages": [], name: value}))
    assert caught.value.status == 400 and caught.value.param == name
    assert "as vLLM reads it" in caught.value.message


def flagged_document(**fields: Any) -> dict[str, Any]:
    decision = inspect_body(orjson.dumps({**FLAG, "messages": [], **fields}))
    assert isinstance(decision, Flagged)
    return decision.document


def test_echo_written_as_1_with_n_written_as_a_string_is_refused_for_the_answers_state() -> None:
    with pytest.raises(ProxyError) as caught:
        check_answerable(flagged_document(echo=1, n="2"))
    assert caught.value.param == "echo"


def test_what_the_client_asked_for_loosely_it_keeps() -> None:
    """``return_token_ids: 1`` and ``include_usage: "true"`` are asked for (vLLM reads them so):
    the proxy must not take the token ids or the usage chunk out of the answer."""
    _, entries, asks = answer_asks(flagged_document(n="2", return_token_ids=1))
    assert entries[CHOICES_ENTRY] == 2 and asks.choices == 2 and not asks.token_ids
    streamed = flagged_document(n=2.0, stream="yes", stream_options={"include_usage": "true"})
    _, entries, asks = answer_asks(streamed)
    assert entries[CHOICES_ENTRY] == 2 and not asks.usage
