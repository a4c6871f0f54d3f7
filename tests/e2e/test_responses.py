"""``POST /v1/responses`` with the flag, through the official openai client on real vLLM: every
vector equals Transformers' on the token ids vLLM built from the request (issue #29)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from tests.e2e.reference import Reference, assert_matches

NO_THINKING = {"enable_thinking": False}


def flagged(**kv: Any) -> dict[str, Any]:
    return {
        "chat_template_kwargs": NO_THINKING,
        "kv_transfer_params": {"return_last_hidden_state": True, **kv},
    }


def kv_of(response: Any) -> dict[str, Any]:
    params = response.model_dump().get("kv_transfer_params")
    assert isinstance(params, dict), f"no kv_transfer_params in {response.model_dump()}"
    return params


def expected_ids(
    reference: Reference, messages: list[dict[str, Any]], response: Any, **template: Any
) -> list[int]:
    ids = reference.chat_token_ids(messages, **NO_THINKING, **template)
    assert response.usage.input_tokens == len(ids), "vLLM built another prompt"
    return ids


@pytest.mark.parametrize(
    ("request_fields", "messages"),
    [
        ({"input": "Name a colour."}, [{"role": "user", "content": "Name a colour."}]),
        (
            {
                "instructions": "Answer in one word.",
                "input": [{"role": "user", "content": "Which river is longest?"}],
            },
            [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Which river is longest?"},
            ],
        ),
    ],
    ids=["string-input", "instructions-and-messages"],
)
def test_a_flagged_response_carries_the_transformers_vector(
    client: Any,
    model_name: str,
    reference: Reference,
    request_fields: dict[str, Any],
    messages: list[dict[str, Any]],
) -> None:
    response = client.responses.create(
        model=model_name,
        max_output_tokens=2,
        temperature=0,
        extra_body=flagged(last_hidden_state_info=True),
        **request_fields,
    )
    ids = expected_ids(reference, messages, response)
    params = kv_of(response)
    assert_matches(params["last_hidden_state"], reference.last_hidden_state(ids))
    info = params["last_hidden_state_info"]
    assert (info["num_prompt_tokens"], info["position"]) == (len(ids), len(ids) - 1)
    assert response.output_text  # vLLM's answer is there as usual


def test_an_assistant_prefill_is_continued_and_its_vector_is_at_its_last_token(
    client: Any, model_name: str, reference: Reference
) -> None:
    conversation = [
        {"role": "user", "content": "Finish the sentence: the sky is"},
        {"role": "assistant", "content": "The sky is"},
    ]
    items = [
        conversation[0],
        {
            "type": "message",
            "role": "assistant",
            "status": "incomplete",  # vLLM continues a partial assistant message
            "content": [{"type": "output_text", "text": "The sky is", "annotations": []}],
        },
    ]
    response = client.responses.create(
        model=model_name, input=items, max_output_tokens=1, temperature=0, extra_body=flagged()
    )
    ids = expected_ids(
        reference,
        conversation,
        response,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert_matches(kv_of(response)["last_hidden_state"], reference.last_hidden_state(ids))


def test_a_flagged_stream_gets_the_vector_on_response_completed(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Tell me about stone walls."}]
    events = list(
        client.responses.create(
            model=model_name,
            input=messages,
            max_output_tokens=4,
            temperature=0,
            stream=True,
            extra_body=flagged(last_hidden_state_format="base64"),
        )
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    final = events[-1].response
    params = kv_of(final)
    for event in events[:-1]:  # vLLM's own null, untouched
        if hasattr(event, "response"):
            assert event.response.model_dump().get("kv_transfer_params") is None
    vector = np.frombuffer(base64.b64decode(params["last_hidden_state"]), dtype="<f4")
    ids = expected_ids(reference, messages, final)
    assert_matches(vector.tolist(), reference.last_hidden_state(ids))


def test_the_stream_helper_s_final_response_has_the_vector_of_each_layer(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    with client.responses.stream(
        model=model_name,
        input=messages,
        max_output_tokens=2,
        temperature=0,
        extra_body=flagged(last_hidden_state_layers=[0, 1, -1]),
    ) as stream:
        final = stream.get_final_response()
    by_layer = kv_of(final)["last_hidden_states_by_layer"]
    ids = expected_ids(reference, messages, final)
    for label, layer in (("0", 0), ("1", 1), ("-1", 2)):
        kind = f"layer {label}, last" if label != "-1" else "layer -1, last"
        expected = reference.layer_vector(ids, layer, "last")
        assert_matches(by_layer[label], expected, kind)


def test_errors_are_as_for_chat(client: Any, model_name: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model_name,
            input="x",
            max_output_tokens=1,
            extra_body=flagged(last_hidden_state_layers=[7]),
        )
    error = caught.value.body
    assert (
        isinstance(error, dict) and error["param"] == "kv_transfer_params.last_hidden_state_layers"
    )
    assert "captures layers 0, 1, 2" in error["message"]
    with pytest.raises(openai.BadRequestError) as reserved:
        client.responses.create(
            model=model_name,
            input="x",
            max_output_tokens=1,
            extra_body={"vllm_xargs": {"hidden_state_proxy_key": "00" * 16}},
        )
    assert isinstance(reserved.value.body, dict) and reserved.value.body["param"] == "vllm_xargs"
