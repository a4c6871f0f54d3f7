"""langchain.py without a server: LangChain's own conversion and chunk merging keep each
choice's vectors apart (the real answers: tests/e2e/test_langchain.py)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import AIMessageChunk
from pydantic import SecretStr

from vllm_hidden_state_proxy.langchain import (
    HiddenStateChatOpenAI,
    HiddenStateEmbeddings,
    hidden_states_of,
)

HIDDEN = 4


def b64(value: float) -> str:
    return base64.b64encode(np.full(HIDDEN, value, "<f4").tobytes()).decode()


def model(**options: Any) -> HiddenStateChatOpenAI:
    return HiddenStateChatOpenAI(
        model="m", base_url="http://proxy.test/v1", api_key=SecretStr("k"), **options
    )


def chunk(index: int, text: str, vector: str | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": index, "delta": {"content": text}, "finish_reason": "stop"}],
    }  # fmt: skip
    if vector is not None:
        document["kv_transfer_params"] = {"last_hidden_state": vector}
    return document


def test_two_choices_chunks_add_up_to_one_vector_each() -> None:
    chat = model()
    chunks = [
        chat._convert_chunk_to_generation_chunk(c, AIMessageChunk, {})
        for c in (chunk(0, "a"), chunk(1, "b", b64(1.0)), chunk(0, "c", b64(2.0)))
    ]
    merged = chunks[0].message  # type: ignore[union-attr]
    for generation in chunks[1:]:
        merged = merged + generation.message  # type: ignore[union-attr,operator]
    by_choice = merged.response_metadata["hidden_states"]
    assert sorted(by_choice) == [0, 1]
    np.testing.assert_array_equal(hidden_states_of(merged, 0).vector, np.full(HIDDEN, 2.0))  # type: ignore[arg-type]
    np.testing.assert_array_equal(hidden_states_of(merged, 1).vector, np.full(HIDDEN, 1.0))  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no hidden states of choice 2"):
        hidden_states_of(merged, 2)


def first_values(result: Any) -> list[float]:
    """Each generation's (choice's) final-layer vector's first value."""
    values = []
    for index, generation in enumerate(result.generations):
        vector = hidden_states_of(generation.message, index).vector
        assert vector is not None
        values.append(float(vector[0]))
    return values


def test_a_json_answer_gives_each_generation_its_choices_entry() -> None:
    choices = [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
        for i in range(2)
    ]
    answer_pooling = {"choices": choices, "kv_transfer_params": {
        "last_hidden_states": [b64(1.0), b64(2.0)]}}  # fmt: skip
    result = model()._create_chat_result(answer_pooling)
    assert first_values(result) == [1.0, 2.0]
    prompt_pooling = {"choices": choices, "kv_transfer_params": {"last_hidden_state": b64(3.0)}}
    result = model()._create_chat_result(prompt_pooling)
    assert first_values(result) == [3.0, 3.0]
    unflagged = model()._create_chat_result({"choices": choices})
    assert "hidden_states" not in unflagged.generations[0].message.response_metadata


def test_a_16_bit_request_is_decoded_as_asked() -> None:
    chat = model(extra_body={"kv_transfer_params": {"last_hidden_state_dtype": "float16"}})
    half = base64.b64encode(np.full(HIDDEN, 0.5, "<f2").tobytes()).decode()
    generation = chat._convert_chunk_to_generation_chunk(chunk(0, "a", half), AIMessageChunk, {})
    assert generation is not None
    np.testing.assert_array_equal(hidden_states_of(generation.message).vector, np.full(HIDDEN, 0.5))  # type: ignore[arg-type]


def test_the_embeddings_never_tokenize_with_tiktoken() -> None:
    embeddings = HiddenStateEmbeddings(model="m", api_key=SecretStr("k"), layer=3)
    assert embeddings.check_embedding_ctx_length is False
    assert embeddings._invocation_params["extra_body"] == {"layer": 3}
    with pytest.raises(ValueError, match="tiktoken"):
        HiddenStateEmbeddings(model="m", api_key=SecretStr("k"), check_embedding_ctx_length=True)
