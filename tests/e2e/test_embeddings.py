"""POST /v1/embeddings on real vLLM with the official client (issue #5)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_MODEL_LEN, RunningStack
from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE

TEXTS = [
    f"Document {i} is about {topic}."
    for i, topic in enumerate(
        [
            "rivers",
            "mountains",
            "bread",
            "music",
            "trains",
            "glaciers",
            "bees",
            "salt",
            "maps",
            "clocks",
            "ink",
            "wool",
            "tides",
            "owls",
            "copper",
            "kites",
        ]
    )
]


def unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def text_reference(
    reference: Reference, text: str, template: str = DEFAULT_TEMPLATE
) -> list[float]:
    messages = [{"role": "user", "content": template.replace("{text}", text)}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    return unit(reference.last_hidden_state(ids))


def test_a_single_input_is_unit_norm_hidden_size_and_the_transformers_vector(
    client: Any, model_name: str, reference: Reference
) -> None:
    response = client.embeddings.create(model=model_name, input="A yellow bicycle.")
    (item,) = response.data
    assert len(item.embedding) == reference.hidden_size
    assert math.sqrt(sum(v * v for v in item.embedding)) == pytest.approx(1.0, abs=1e-6)
    assert_matches(item.embedding, text_reference(reference, "A yellow bicycle."))
    assert response.model == model_name
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0


def test_a_batch_of_16_in_order_each_equal_to_the_text_alone(
    client: Any, model_name: str, reference: Reference
) -> None:
    batch = client.embeddings.create(model=model_name, input=TEXTS)
    assert [d.index for d in batch.data] == list(range(16))
    alone_tokens = 0
    for text, item in zip(TEXTS, batch.data, strict=True):
        alone = client.embeddings.create(model=model_name, input=text)
        alone_tokens += alone.usage.prompt_tokens
        assert_matches(item.embedding, alone.data[0].embedding)
        assert_matches(item.embedding, text_reference(reference, text))
    assert batch.usage.prompt_tokens == alone_tokens


def test_base64_equals_float(stack: RunningStack, model_name: str) -> None:
    def ask(fmt: str) -> Any:
        body = {"model": model_name, "input": TEXTS[:3], "encoding_format": fmt}
        response = httpx.post(stack.proxy_url + "/v1/embeddings", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return [d["embedding"] for d in response.json()["data"]]

    floats, encoded = ask("float"), ask("base64")
    for values, text in zip(floats, encoded, strict=True):
        # float32s' shortest decimals: read as float32, the very bytes base64 carries
        assert base64.b64decode(text) == np.array(values, dtype="<f4").tobytes()


def test_the_openai_clients_base64_paths(
    client: Any, model_name: str, reference: Reference
) -> None:
    expected = text_reference(reference, TEXTS[4])
    # Without encoding_format the official client asks for base64 and decodes it itself...
    assert_matches(
        client.embeddings.create(model=model_name, input=TEXTS[4]).data[0].embedding, expected
    )
    # ...asked for explicitly, it hands the base64 string over.
    response = client.embeddings.create(model=model_name, input=TEXTS[4], encoding_format="base64")
    raw = base64.b64decode(response.data[0].embedding)
    assert_matches(list(struct.unpack(f"<{len(raw) // 4}f", raw)), expected)


def test_chat_form_messages_is_that_conversations_vector(
    client: Any, model_name: str, reference: Reference
) -> None:
    messages = [
        {"role": "system", "content": "You label fruit."},
        {"role": "user", "content": "Is a tomato a fruit?"},
    ]
    # vLLM's chat-form extension: 'messages' instead of 'input' (a raw POST with the client)
    body = {"model": model_name, "messages": messages}
    raw = client.post("/embeddings", body=body, cast_to=httpx.Response)
    data = raw.json()["data"]
    ids = reference.chat_token_ids(messages, add_generation_prompt=False)
    assert_matches(data[0]["embedding"], unit(reference.last_hidden_state(ids)))
    with_prompt = client.post(
        "/embeddings",
        body={
            **body,
            "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        cast_to=httpx.Response,
    ).json()["data"][0]["embedding"]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert_matches(with_prompt, unit(reference.last_hidden_state(ids)))


def test_token_id_input_skips_the_template(
    client: Any, model_name: str, reference: Reference
) -> None:
    ids = [list(reference.tokenizer(t)["input_ids"]) for t in ("raw ids one", "and two")]
    response = client.embeddings.create(model=model_name, input=ids)
    for prompt, item in zip(ids, response.data, strict=True):
        assert_matches(item.embedding, unit(reference.last_hidden_state(prompt)))
    assert response.usage.prompt_tokens == sum(len(p) for p in ids)


def test_instruction_overrides_the_template(
    client: Any, model_name: str, reference: Reference
) -> None:
    template = "Represent this for retrieval: {text}"
    response = client.embeddings.create(
        model=model_name, input="snowy owl", extra_body={"instruction": template}
    )
    assert_matches(response.data[0].embedding, text_reference(reference, "snowy owl", template))


@pytest.mark.parametrize(
    ("payload", "param", "fragment"),
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["ok", 3]}, "input", "not a mix"),
        ({"input": "x", "encoding_format": "fp16"}, "encoding_format", "float, base64"),
        ({"input": "x", "dimensions": 64}, "dimensions", "Matryoshka"),
        ({"input": "x", "normalize": "no"}, "normalize", "boolean"),
        ({"input": ["fine", "word " * (MAX_MODEL_LEN * 2)]}, "input", "input[1]"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    stack: RunningStack,
    client: Any,
    model_name: str,
    payload: dict[str, Any],
    param: str,
    fragment: str,
) -> None:
    response = httpx.post(
        stack.proxy_url + "/v1/embeddings", json={"model": model_name, **payload}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert fragment in error["message"]
    # and the server keeps serving
    assert client.embeddings.create(model=model_name, input="still here").data
