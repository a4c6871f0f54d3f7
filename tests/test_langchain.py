"""langchain.py without a server: LangChain's own conversion and chunk merging keep each
choice's vectors apart (the real answers: tests/e2e/test_langchain.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest
from langchain_core.messages import AIMessageChunk, BaseMessageChunk
from pydantic import SecretStr

from vllm_hidden_state_proxy.client import (
    HiddenStateDecodeError,
    HiddenStateServerError,
    hidden_state_fields,
)
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


def sse_stream(kv_by_chunk: list[dict[str, Any] | None]) -> bytes:
    """A chat stream with n=2 as vLLM (through the proxy) sends it: each choice's role chunk,
    then each choice's last chunk; ``kv_by_chunk`` the kv_transfer_params of each of those 4."""
    shapes = [(0, {"role": "assistant", "content": ""}, None),
              (1, {"role": "assistant", "content": ""}, None),
              (1, {"content": "b"}, "stop"), (0, {"content": "a"}, "stop")]  # fmt: skip
    events = []
    for (index, delta, finish), kv in zip(shapes, kv_by_chunk, strict=True):
        document: dict[str, Any] = {
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        }  # fmt: skip
        if kv is not None:
            document["kv_transfer_params"] = kv
        events.append(f"data: {json.dumps(document)}\n\n")
    return ("".join(events) + "data: [DONE]\n\n").encode()


def streaming_model(body: bytes, sent: list[dict[str, Any]], **options: Any) -> Any:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    transport = httpx.MockTransport(answer)
    return model(
        http_client=httpx.Client(transport=transport),
        http_async_client=httpx.AsyncClient(transport=transport),
        **options,
    )


def merged_stream(chat: HiddenStateChatOpenAI, use_async: bool, **call: Any) -> Any:
    async def collect() -> list[BaseMessageChunk]:
        return [chunk async for chunk in chat.astream("Hi", **call)]

    chunks = asyncio.run(collect()) if use_async else list(chat.stream("Hi", **call))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    return merged


def b16(value: float, dtype: str) -> str:
    values = np.full(HIDDEN, value, "<f4")
    raw = values.astype("<f2") if dtype == "float16" else (values.view("<u4") >> 16).astype("<u2")
    return base64.b64encode(raw.tobytes()).decode()


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_a_streamed_prompt_pooling_gives_every_choice_its_entry(use_async: bool) -> None:
    """The proxy sends a prompt pooling's vectors once, on the stream's first chunk with a
    choice; every choice of n=2 gets them (n and extra_body given per call here). Their 16-bit
    values read right: the answer says its dtype."""
    kv = {"last_hidden_state": b16(0.5, "bfloat16"), "last_hidden_state_dtype": "bfloat16"}
    sent: list[dict[str, Any]] = []
    chat = streaming_model(sse_stream([kv, None, None, None]), sent)
    extra_body = hidden_state_fields(dtype="bfloat16")
    merged = merged_stream(chat, use_async, n=2, extra_body=extra_body)
    assert (sent[0]["n"], sent[0]["kv_transfer_params"]) == (2, extra_body["kv_transfer_params"])
    by_choice = merged.response_metadata["hidden_states"]
    assert sorted(by_choice) == [0, 1] and by_choice[0] is by_choice[1]
    np.testing.assert_array_equal(hidden_states_of(merged, 1).vector, np.full(HIDDEN, 0.5))  # type: ignore[arg-type]


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_a_streamed_answer_pooling_keeps_each_choices_own(use_async: bool) -> None:
    fields = hidden_state_fields(pooling="last_answer")
    kvs = [None, None, {"last_hidden_state": b64(2.0)}, {"last_hidden_state": b64(1.0)}]
    chat = streaming_model(sse_stream(kvs), [], n=2, extra_body=fields)
    merged = merged_stream(chat, use_async)
    np.testing.assert_array_equal(hidden_states_of(merged, 0).vector, np.full(HIDDEN, 1.0))  # type: ignore[arg-type]
    np.testing.assert_array_equal(hidden_states_of(merged, 1).vector, np.full(HIDDEN, 2.0))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_values_read_in_the_dtype_the_answer_says(dtype: str) -> None:
    kv = {"last_hidden_state": b16(0.5, dtype), "last_hidden_state_dtype": dtype}
    document = {**chunk(0, "a"), "kv_transfer_params": kv}
    generation = model()._convert_chunk_to_generation_chunk(document, AIMessageChunk, {})
    assert generation is not None
    np.testing.assert_array_equal(hidden_states_of(generation.message).vector, np.full(HIDDEN, 0.5))  # type: ignore[arg-type]


def test_the_embeddings_never_tokenize_with_tiktoken() -> None:
    embeddings = HiddenStateEmbeddings(model="m", api_key=SecretStr("k"), layer=3)
    assert embeddings.check_embedding_ctx_length is False
    assert embeddings._invocation_params["extra_body"] == {"layer": 3}
    with pytest.raises(ValueError, match="tiktoken"):
        HiddenStateEmbeddings(model="m", api_key=SecretStr("k"), check_embedding_ctx_length=True)


# -- hostile answers and chunks (issue #50) ----------------------------------------------------


def test_chunks_merge_by_choice_without_comparing_arrays() -> None:
    """The same entry added again merges (LangChain compared the arrays: "the truth value of an
    array is ambiguous"); a stream's second entry for one choice is refused clearly."""
    chat = model()
    generation = chat._convert_chunk_to_generation_chunk(
        chunk(0, "a", b64(1.0)), AIMessageChunk, {}
    )
    assert generation is not None
    merged = generation.message + generation.message  # type: ignore[operator]
    np.testing.assert_array_equal(hidden_states_of(merged).vector, np.full(HIDDEN, 1.0))  # type: ignore[arg-type]

    kvs = [None, None, {"last_hidden_state": b64(2.0)}, {"last_hidden_state": b64(2.0)}]
    body = sse_stream(kvs).replace(b'"index": 1', b'"index": 0')  # both for choice 0
    fields = hidden_state_fields(pooling="last_answer")
    for use_async in (False, True):
        chat = streaming_model(body, [], n=2, extra_body=fields)
        with pytest.raises(HiddenStateDecodeError, match="choice 0's hidden states came twice"):
            merged_stream(chat, use_async)


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_a_streamed_entry_for_a_choice_the_request_has_not_is_refused(use_async: bool) -> None:
    kvs = [None, None, {"last_hidden_state": b64(2.0)}, None]
    body = sse_stream(kvs).replace(b'"index": 1', b'"index": 5')
    chat = streaming_model(body, [], extra_body=hidden_state_fields(pooling="last_answer"))
    with pytest.raises(HiddenStateDecodeError, match=r"choice 5.*1 choice"):
        merged_stream(chat, use_async)


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_vllms_error_chunk_is_a_server_error(use_async: bool) -> None:
    error = {"object": "error", "message": "the engine died", "type": "InternalServerError",
             "code": 500}  # fmt: skip
    body = sse_stream([None, None, None, None]).replace(
        b"data: [DONE]", b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]"
    )
    chat = streaming_model(body, [], extra_body=hidden_state_fields())
    with pytest.raises(HiddenStateServerError, match="the engine died"):
        merged_stream(chat, use_async)


def two_choices(*indices: Any) -> list[dict[str, Any]]:
    return [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
        for i in indices
    ]


#: JSON answers whose entries do not match their choices, and what the refusal says.
MISMATCHED: list[tuple[dict[str, Any], str]] = [
    # last_answer, n = 2, one entry: choice 1 got choice 0's vector
    ({"choices": two_choices(0, 1), "kv_transfer_params": {
        "last_hidden_states": [b64(1.0)]}}, "1 entries of hidden states for 2 choices"),
    ({"choices": two_choices(0, 7), "kv_transfer_params": {
        "last_hidden_states": [b64(1.0), b64(2.0)]}}, r"choices\[1\]\.index is 7"),
    ({"choices": two_choices(0, "1"), "kv_transfer_params": {
        "last_hidden_states": [b64(1.0), b64(2.0)]}}, r"choices\[1\]\.index is '1'"),
    ({"choices": two_choices(0, 0), "kv_transfer_params": {
        "last_hidden_states": [b64(1.0), b64(2.0)]}}, r"choices\[1\]\.index is 0"),
    ({"choices": two_choices(0, 1), "kv_transfer_params": {
        "last_hidden_state": b64(1.0),
        "last_hidden_state_info": {"pooling": "last_answer"}}}, "one entry of last_answer"),
]  # fmt: skip


@pytest.mark.parametrize(("answer", "fragment"), MISMATCHED, ids=[f for _, f in MISMATCHED])
def test_a_json_answer_whose_entries_do_not_match_its_choices_is_refused(
    answer: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(HiddenStateDecodeError, match=fragment):
        model()._create_chat_result(answer)
