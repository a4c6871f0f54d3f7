"""LangChain (issue #37), langchain-openai's release, on real vLLM through the proxy:
``HiddenStateChatOpenAI`` keeps each choice's vectors in ``response_metadata`` for invoke,
ainvoke, stream and astream (n = 1 and n = 2, never concatenated by chunk merging; a streamed
prompt pooling's entry for every choice), and
``HiddenStateEmbeddings`` returns Transformers' vectors (the text sent, not tiktoken's ids).

The raw answers (with vLLM's ``token_ids``, which LangChain drops) are captured by an event hook
on the SDK's HTTP client, to know each choice's tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage
from pydantic import SecretStr

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import SHARED_LAYERS, RunningStack
from vllm_hidden_state_proxy.client import hidden_state_fields
from vllm_hidden_state_proxy.langchain import (
    HiddenStateChatOpenAI,
    HiddenStateEmbeddings,
    hidden_states_of,
)

LAYERS = [int(layer) for layer in SHARED_LAYERS]


class RawAnswers:
    """The bodies of every response the SDK receives (JSON, or a stream's data events)."""

    def __init__(self) -> None:
        self.bodies: list[str] = []

    def hook(self, response: Any) -> None:
        response.read()
        self.bodies.append(response.text)

    async def ahook(self, response: Any) -> None:
        await response.aread()
        self.bodies.append(response.text)

    def choices(self) -> tuple[list[int], dict[int, list[int]]]:
        """The prompt's token ids and each choice's, from the last response."""
        text = self.bodies[-1]
        if text.lstrip().startswith("{"):
            document = json.loads(text)
            return document["prompt_token_ids"], {
                c["index"]: c["token_ids"] for c in document["choices"]
            }
        prompt: list[int] = []
        answers: dict[int, list[int]] = {}
        for line in text.splitlines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            prompt = chunk.get("prompt_token_ids") or prompt
            for choice in chunk.get("choices", []):
                answers.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
        return prompt, answers


def chat_model(
    stack: RunningStack, model: str, *, clients: list[Any], raw: RawAnswers | None = None, **kv: Any
) -> Any:
    """The chat model with HTTP clients of its own (appended to ``clients``, for the test to
    close: langchain-openai's shared default async client would outlive the test's loop)."""
    from openai import DefaultAsyncHttpxClient, DefaultHttpxClient

    kv.setdefault("layers", LAYERS)
    hooks = {"response": [raw.hook]} if raw is not None else {}
    http_client = DefaultHttpxClient(event_hooks=hooks)
    ahooks = {"response": [raw.ahook]} if raw is not None else {}
    http_async_client = DefaultAsyncHttpxClient(event_hooks=ahooks)
    clients += [http_client, http_async_client]
    return HiddenStateChatOpenAI(
        model=model,
        base_url=stack.proxy_url + "/v1",
        api_key=SecretStr("unused"),
        max_retries=0,
        max_completion_tokens=4,
        extra_body={**NO_THINKING, **hidden_state_fields(**kv), "return_token_ids": True},
        http_client=http_client,
        http_async_client=http_async_client,
    )


@pytest.fixture()
def clients() -> Iterator[list[Any]]:
    """HTTP clients a test made: closed at its end (the async ones in a loop of their own)."""
    made: list[Any] = []
    yield made

    async def close_async() -> None:
        for client in made:
            if hasattr(client, "aclose"):
                await client.aclose()

    asyncio.run(close_async())
    for client in made:
        if hasattr(client, "close") and not hasattr(client, "aclose"):
            client.close()


def check_entry(reference: Reference, ids: list[int], entry: Any) -> None:
    assert sorted(entry.by_layer) == sorted(LAYERS)
    for layer, vector in entry.by_layer.items():
        assert vector.shape == (reference.hidden_size,)  # one vector, never two joined
        expected = reference.layer_vector(ids, layer, "last")
        assert_matches(vector.tolist(), expected, f"layer {layer}, langchain")


def prompt_ids(reference: Reference, content: str) -> list[int]:
    return reference.chat_token_ids([{"role": "user", "content": content}], enable_thinking=False)


def added_up(chunks: list[Any]) -> Any:
    """LangChain's own merge of a stream's chunks (it joins lists and strings)."""
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    return merged


def test_invoke_and_stream_keep_the_prompts_vectors(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    model = chat_model(stack, model_name, clients=clients)
    content = "LangChain invoke: a lighthouse."
    message = model.invoke(content)
    check_entry(reference, prompt_ids(reference, content), hidden_states_of(message))
    content = "LangChain stream: a harbour."
    chunks = list(model.stream(content))
    assert len([c for c in chunks if "hidden_states" in c.response_metadata]) == 1
    check_entry(reference, prompt_ids(reference, content), hidden_states_of(added_up(chunks)))


def test_ainvoke_and_astream_keep_the_prompts_vectors(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    model = chat_model(stack, model_name, clients=clients)
    invoked, streamed = "LangChain ainvoke: a bridge.", "LangChain astream: a tower."

    async def both() -> tuple[Any, list[Any]]:
        message = await model.ainvoke(invoked)
        chunks = [chunk async for chunk in model.astream(streamed)]
        for client in clients:  # in this loop, which closes after
            if hasattr(client, "aclose"):
                await client.aclose()
        return message, chunks

    message, chunks = asyncio.run(both())
    check_entry(reference, prompt_ids(reference, invoked), hidden_states_of(message))
    assert len([c for c in chunks if "hidden_states" in c.response_metadata]) == 1
    check_entry(reference, prompt_ids(reference, streamed), hidden_states_of(added_up(chunks)))


def test_two_choices_invoked_each_get_their_answers_state(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    raw = RawAnswers()
    model = chat_model(stack, model_name, clients=clients, raw=raw, pooling="last_answer")
    question = HumanMessage("LangChain n=2: name a sea.")
    result = model.generate([[question]], n=2, temperature=1.0)
    [generations] = result.generations
    assert len(generations) == 2
    prompt, answers = raw.choices()
    for index, generation in enumerate(generations):
        entry = hidden_states_of(generation.message, index)
        check_entry(reference, [*prompt, *answers[index][:-1]], entry)


def test_two_choices_streamed_are_never_concatenated(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    raw = RawAnswers()
    model = chat_model(stack, model_name, clients=clients, raw=raw, pooling="last_answer")
    chunks = list(model.stream("LangChain n=2 stream: name a river.", n=2, temperature=1.0))
    carrying = [c for c in chunks if "hidden_states" in c.response_metadata]
    assert len(carrying) == 2  # each choice's last chunk
    merged = added_up(chunks)
    prompt, answers = raw.choices()
    assert sorted(merged.response_metadata["hidden_states"]) == [0, 1]
    for index in (0, 1):
        check_entry(reference, [*prompt, *answers[index][:-1]], hidden_states_of(merged, index))


def test_two_choices_agenerated_and_astreamed_each_get_their_answers_state(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    raw = RawAnswers()
    model = chat_model(stack, model_name, clients=clients, raw=raw, pooling="last_answer")
    question = HumanMessage("LangChain n=2 agenerate: name a sea.")

    async def both() -> tuple[Any, tuple[list[int], dict[int, list[int]]], list[Any]]:
        generated = await model.agenerate([[question]], n=2, temperature=1.0)
        generated_choices = raw.choices()
        chunks = [
            c async for c in model.astream("LangChain n=2 astream: a river.", n=2, temperature=1.0)
        ]
        for client in clients:  # in this loop, which closes after
            if hasattr(client, "aclose"):
                await client.aclose()
        return generated, generated_choices, chunks

    result, (prompt, answers), chunks = asyncio.run(both())
    [generations] = result.generations
    assert len(generations) == 2
    for index, generation in enumerate(generations):
        entry = hidden_states_of(generation.message, index)
        check_entry(reference, [*prompt, *answers[index][:-1]], entry)
    merged = added_up(chunks)
    prompt, answers = raw.choices()
    assert sorted(merged.response_metadata["hidden_states"]) == [0, 1]
    for index in (0, 1):
        check_entry(reference, [*prompt, *answers[index][:-1]], hidden_states_of(merged, index))


@pytest.mark.parametrize("use_async", [False, True], ids=["stream", "astream"])
def test_a_streamed_prompt_pooling_gives_every_choice_the_prompts_state(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any], use_async: bool
) -> None:
    """The proxy sends the prompt's vectors once, on the first chunk with a choice; with
    n = 2 (given per call) both choices have them."""
    model = chat_model(stack, model_name, clients=clients)
    content = f"LangChain n=2 prompt, {'astream' if use_async else 'stream'}: a bay."

    async def streamed() -> list[Any]:
        chunks = [c async for c in model.astream(content, n=2, temperature=1.0)]
        for client in clients:
            if hasattr(client, "aclose"):
                await client.aclose()
        return chunks

    chunks = (
        asyncio.run(streamed()) if use_async else list(model.stream(content, n=2, temperature=1.0))
    )
    assert len([c for c in chunks if "hidden_states" in c.response_metadata]) == 1
    merged = added_up(chunks)
    assert sorted(merged.response_metadata["hidden_states"]) == [0, 1]
    ids = prompt_ids(reference, content)
    for index in (0, 1):
        check_entry(reference, ids, hidden_states_of(merged, index))


def test_the_embeddings_class_sends_text_and_returns_transformers_vectors(
    stack: RunningStack, model_name: str, reference: Reference, clients: list[Any]
) -> None:
    from openai import DefaultHttpxClient

    clients.append(DefaultHttpxClient())
    embeddings = HiddenStateEmbeddings(
        http_client=clients[-1],
        model=model_name,
        base_url=stack.proxy_url + "/v1",
        api_key=SecretStr("unused"),
        max_retries=0,
        layer=1,
        pooling="mean",
        normalize=False,
        instruction="{text}",
    )
    texts = ["A yellow bicycle.", "A stone wall beside it."]
    vectors = embeddings.embed_documents(texts)
    for text, vector in zip(texts, vectors, strict=True):
        ids = prompt_ids(reference, text)  # the instruction "{text}": the text alone
        assert_matches(vector, reference.layer_vector(ids, 1, "mean"), "layer 1, mean")
    with pytest.raises(ValueError, match="tiktoken"):
        HiddenStateEmbeddings(
            model=model_name, api_key=SecretStr("x"), check_embedding_ctx_length=True
        )
    assert np.isfinite(embeddings.embed_query("One more.")).all()
