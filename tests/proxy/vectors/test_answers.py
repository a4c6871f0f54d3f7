"""The answer's vectors (pooling "last_answer", proxy/vectors/answers.py and
streams/answer_vectors.py): one per choice, found by its token count, in JSON answers and on each
choice's last chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    HIDDEN_SIZE,
    MODEL,
    FakeVLLM,
    create_writer,
    error_of,
    forwarded_key,
    proxy_client,
    publish,
    sent_document,
    settings_for,
    vector_bytes,
    vector_for,
)
from vllm_hidden_state_proxy.protocol import (
    CHOICES_ENTRY,
    POOLING_ENTRY,
    answer_key,
    prompt_key,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.vectors.answers import (
    AnswerAsks,
    answer_asks,
    choice_counts,
    without_asked_token_ids,
)
from vllm_hidden_state_proxy.ring import ErrorRecord, Record, RingWriter

pytestmark = pytest.mark.anyio


@pytest.fixture
def wide_writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring of 1024 slots (a list sent as one request takes at most a quarter)."""
    with create_writer(ring_dir, slot_count=1024) as ring:
        yield ring


CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 5
#: Each choice's generated token ids (choice i generates i + 2 tokens).
ANSWERS = [[11, 12], [21, 22, 23], [31, 32, 33, 34]]


def flagged(**extra: Any) -> dict[str, Any]:
    kv = {"return_last_hidden_state": True, "last_hidden_state_pooling": "last_answer"}
    kv.update(extra.pop("kv", {}))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
        "kv_transfer_params": kv,
    }


def answer_record(key: bytes, choice: int, count: int, *, shift: int = 0) -> Record:
    """What the hook publishes for the state that chose token ``count`` of ``choice``: its
    vector is told apart by (choice, count)."""
    values = [v + 100.0 * choice + count for v in vector_for(key)]
    return Record(
        answer_key(key, choice, count),
        MODEL,
        PROMPT_TOKENS + count - 2 + shift,
        PROMPT_TOKENS,
        "last_answer",
        (FINAL,),
        HIDDEN_SIZE,
        vector_bytes(values),
    )


def expected_vector(key: bytes, choice: int, count: int) -> list[float]:
    return [v + 100.0 * choice + count for v in vector_for(key)]


def publish_window(hook: RingWriter, key: bytes, choice: int, count: int) -> None:
    """Like the hook: the answer's latest computed positions, one past the last included."""
    for chosen in range(max(1, count - 2), count + 2):
        publish(hook, answer_record(key, choice, chosen))


def json_reply(n: int, with_ids: bool) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "stop",
                "token_ids": ANSWERS[i] if with_ids else None,
            }
            for i in range(n)
        ],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": 7},
        "prompt_token_ids": list(range(PROMPT_TOKENS)) if with_ids else None,
        "kv_transfer_params": None,
    }


def json_vllm(hook: RingWriter, *, shift: int = 0, error: str | None = None) -> FakeVLLM:
    async def handle(request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        key = forwarded_key(request)
        n = int(document.get("n") or 1)
        if error is not None:
            publish(hook, ErrorRecord(key, error))
        else:
            for i in range(n):
                count = len(ANSWERS[i])
                publish(hook, answer_record(key, i, count, shift=shift))
                publish(hook, answer_record(key, i, count + 1))  # the step past the stop
        return httpx.Response(200, json=json_reply(n, document.get("return_token_ids") is True))

    return FakeVLLM(handle)


async def test_json_answer_gets_the_state_that_chose_the_last_token(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = json_vllm(writer)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(kv={"last_hidden_state_info": True}))
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    sent = sent_document(forwarded)
    key = forwarded_key(forwarded)
    assert "return_token_ids" not in sent  # one choice: usage counts its tokens
    assert sent["vllm_xargs"][POOLING_ENTRY] == "last_answer"
    assert CHOICES_ENTRY not in sent["vllm_xargs"]
    assert "cache_salt" not in sent  # the answer's states are computed, never cached
    body = response.json()
    kv = body["kv_transfer_params"]
    assert kv["last_hidden_state"] == expected_vector(key, 0, 2)
    assert kv["last_hidden_state_info"]["position"] == PROMPT_TOKENS + 2 - 2
    assert kv["last_hidden_state_info"]["num_output_tokens"] == 2
    assert kv["last_hidden_state_info"]["pooling"] == "last_answer"
    assert body == {**json_reply(1, False), "kv_transfer_params": kv}  # vLLM's reply, as it was


async def test_n_choices_get_one_vector_each_in_choice_order(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = json_vllm(writer)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(n=3, return_token_ids=True))
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    key = forwarded_key(forwarded)
    assert sent_document(forwarded)["vllm_xargs"][CHOICES_ENTRY] == 3
    body = response.json()
    assert body["kv_transfer_params"]["last_hidden_states"] == [
        expected_vector(key, i, len(ANSWERS[i])) for i in range(3)
    ]
    assert [c["token_ids"] for c in body["choices"]] == ANSWERS  # asked for: kept


async def test_a_record_of_another_position_is_a_502_never_its_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = json_vllm(writer, shift=1)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 502
    assert "disagree" in error_of(response)["message"]


async def test_an_error_record_under_the_request_key_answers_every_choice(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = json_vllm(writer, error="speculative decoding cannot give the answer's state")
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(n=2))
    assert response.status_code == 502
    assert "speculative decoding" in error_of(response)["message"]


async def test_no_record_is_a_timeout(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=json_reply(1, True))

    settings = settings_for(ring_dir, vector_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 504


# ---------------------------------------------------------------------------------------------
# streams
# ---------------------------------------------------------------------------------------------


FINGERPRINT = "fp-1"


def sse(chunk: dict[str, Any], separator: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(chunk) + separator


def stream_events(n: int, continuous: bool, usage: bool, separator: bytes = b"\n\n") -> list[bytes]:
    """vLLM's chat stream of ``n`` choices, interleaved, with continuous usage per choice; its
    fingerprint on each choice's last chunk, or (with usage) on the usage chunk, as vLLM does."""
    events = []
    for i in range(n):
        chunk: dict[str, Any] = {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}],
        }
        if continuous:
            chunk["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 0}
        events.append(sse(chunk, separator))
    longest = max(len(ANSWERS[i]) for i in range(n))
    for step in range(longest):
        for i in range(n):
            if step >= len(ANSWERS[i]):
                continue
            last = step == len(ANSWERS[i]) - 1
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": i,
                        "delta": {"content": f"t{step}"},
                        "finish_reason": "stop" if last else None,
                    }
                ],
            }
            if last and not usage:
                chunk["system_fingerprint"] = FINGERPRINT
            if continuous:
                chunk["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": step + 1}
            events.append(sse(chunk, separator))
    if usage:
        final = {"id": "c", "choices": [], "usage": {"completion_tokens": 9}}
        events.append(sse({**final, "system_fingerprint": FINGERPRINT}, separator))
    events.append(b"data: [DONE]" + separator)
    return events


def stream_vllm(
    hook: RingWriter | None,
    *,
    piece: int = 1 << 20,
    separator: bytes = b"\n\n",
    published: int | None = None,
) -> FakeVLLM:
    """A streaming vLLM whose body arrives ``piece`` bytes at a time; the hook publishes the
    records of the first ``published`` choices (all by default)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        key = forwarded_key(request)
        n = int(document.get("n") or 1)
        options = document["stream_options"]
        if hook is not None:
            for i in range(n if published is None else published):
                publish_window(hook, key, i, len(ANSWERS[i]))
        usage = options.get("include_usage") is True
        continuous = usage and options.get("continuous_usage_stats") is True
        body = b"".join(stream_events(n, continuous, usage, separator))

        async def pieces() -> AsyncIterator[bytes]:
            for at in range(0, len(body), piece):
                yield body[at : at + piece]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=pieces())

    return FakeVLLM(handle)


def data_of(text: str) -> list[Any]:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    events = [e for e in text.split("\n\n") if e]
    return [
        e.removeprefix("data: ") if e == "data: [DONE]" else orjson.loads(e[6:]) for e in events
    ]


@pytest.mark.parametrize(
    ("piece", "separator"), [(1 << 20, b"\n\n"), (1, b"\n\n"), (7, b"\r\n\r\n"), (3, b"\r\r")]
)
@pytest.mark.parametrize("n", [1, 2])
async def test_a_stream_carries_each_choices_vector_on_its_last_chunk(
    ring_dir: str, writer: RingWriter, piece: int, separator: bytes, n: int
) -> None:
    vllm = stream_vllm(writer, piece=piece, separator=separator)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(n=n, stream=True))
    assert response.status_code == 200
    (forwarded,) = vllm.requests
    key = forwarded_key(forwarded)
    options = sent_document(forwarded)["stream_options"]
    assert options == {"include_usage": True, "continuous_usage_stats": True}
    received = data_of(response.text)
    assert received[-1] == "[DONE]"
    chunks = received[:-1]
    # the proxy's usage asks are gone: no chunk has usage, no usage-only chunk
    assert all("usage" not in chunk and chunk["choices"] for chunk in chunks)
    with_vectors = [c for c in chunks if "kv_transfer_params" in c]
    assert [c["choices"][0]["finish_reason"] for c in with_vectors] == ["stop"] * n
    for chunk in with_vectors:
        index = chunk["choices"][0]["index"]
        vector = chunk["kv_transfer_params"]["last_hidden_state"]
        assert vector == expected_vector(key, index, len(ANSWERS[index]))
    # every other chunk as vLLM streamed it without the proxy's asks, in its order; one choice's
    # last chunk with vLLM's fingerprint, taken from the usage chunk (several: without)
    plain = stream_events(n, continuous=False, usage=False)
    expected_plain = [orjson.loads(e[6:]) for e in plain[:-1]]
    if n > 1:
        expected_plain = [
            {k: v for k, v in c.items() if k != "system_fingerprint"} for c in expected_plain
        ]
    stripped = [{k: v for k, v in c.items() if k != "kv_transfer_params"} for c in chunks]
    assert stripped == expected_plain


async def test_a_client_asking_for_usage_keeps_it(ring_dir: str, writer: RingWriter) -> None:
    vllm = stream_vllm(writer)
    body = flagged(stream=True, stream_options={"include_usage": True})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    chunks = data_of(response.text)[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"completion_tokens": 9}
    assert all("usage" not in c for c in chunks[:-1])  # continuous usage was the proxy's ask


@pytest.mark.parametrize("client_usage", [False, True])
async def test_a_stream_whose_record_is_missing_ends_with_an_error_event(
    ring_dir: str, writer: RingWriter, client_usage: bool
) -> None:
    settings = settings_for(ring_dir, vector_timeout=0.05)
    extra = {"stream_options": {"include_usage": True}} if client_usage else {}
    async with proxy_client(settings, stream_vllm(writer, published=1)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(n=2, stream=True, **extra))
    assert response.status_code == 200  # the stream had started
    received = data_of(response.text)
    assert "[DONE]" not in received
    assert received[-1]["error"]["code"] == 504
    chunks = received[:-1]
    # everything before the failing choice's last chunk went out, choice 0's vectors with it
    assert len(chunks) == len(stream_events(2, False, False)) - 2
    finished = [c for c in chunks if c["choices"][0].get("finish_reason")]
    assert [c["choices"][0]["index"] for c in finished] == [0]
    assert "last_hidden_state" in finished[0]["kv_transfer_params"]


# ---------------------------------------------------------------------------------------------
# where it is refused, and the pure parts
# ---------------------------------------------------------------------------------------------


async def test_responses_and_embeddings_refuse_last_answer(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = json_vllm(writer)
    kv = {"return_last_hidden_state": True, "last_hidden_state_pooling": "last_answer"}
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        responses = await proxy.client.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "kv_transfer_params": kv}
        )
        embeddings = await proxy.client.post(
            "/v1/embeddings", json={"model": MODEL, "input": "Hi", "pooling": "last_answer"}
        )
    assert responses.status_code == 400 and "/v1/responses" in error_of(responses)["message"]
    assert embeddings.status_code == 400 and error_of(embeddings)["param"] == "pooling"
    assert not vllm.requests


def test_answer_asks_adds_what_counts_tokens_and_says_what_it_added() -> None:
    assert answer_asks({}) == ({}, {}, AnswerAsks())  # one choice: usage says it
    fields, entries, asks = answer_asks({"n": 2})
    assert (fields, entries, asks) == (
        {"return_token_ids": True},
        {CHOICES_ENTRY: 2},
        AnswerAsks(token_ids=True, choices=2),
    )
    fields, entries, asks = answer_asks(
        {"stream": True, "stream_options": {"include_usage": True, "x": 1}}
    )
    assert fields == {
        "stream_options": {"include_usage": True, "x": 1, "continuous_usage_stats": True}
    }
    assert (entries, asks) == ({}, AnswerAsks(usage=False, continuous_usage=True))
    assert answer_asks({"return_token_ids": True, "n": 2})[2] == AnswerAsks(choices=2)
    # continuous usage without include_usage: vLLM would have sent none
    options = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert answer_asks(options)[2] == AnswerAsks(usage=True, continuous_usage=True)
    assert answer_asks({"stream": True, "stream_options": "bad"}) == ({}, {}, AnswerAsks())


def test_choice_counts_needs_token_ids_and_at_least_one_token() -> None:
    counts = choice_counts(json_reply(2, True))
    assert [(c.index, c.num_output_tokens, c.num_prompt_tokens) for c in counts] == [
        (0, 2, PROMPT_TOKENS),
        (1, 3, PROMPT_TOKENS),
    ]
    (one,) = choice_counts(json_reply(1, False))  # one choice: from usage
    assert (one.index, one.num_output_tokens, one.num_prompt_tokens) == (0, 2, PROMPT_TOKENS)
    with pytest.raises(ProxyError) as missing:
        choice_counts(json_reply(2, False))
    assert missing.value.status == 502
    empty = json_reply(1, True)
    empty["choices"][0]["token_ids"] = []
    with pytest.raises(ProxyError) as none:
        choice_counts(empty)
    assert none.value.status == 400


def test_without_asked_token_ids_restores_vllms_nulls() -> None:
    reply = json_reply(2, True)
    restored = without_asked_token_ids(reply, AnswerAsks(token_ids=True))
    assert restored == json_reply(2, False)
    assert without_asked_token_ids(reply, AnswerAsks()) is reply


async def test_a_prompt_list_gets_one_vector_per_merged_choice(
    ring_dir: str, wide_writer: RingWriter
) -> None:
    writer = wide_writer
    """One request for the list: choice ``j`` of the reply is choice ``j % n`` of prompt
    ``j // n``, whose records are under that prompt's key (the hook's ``prompt_key``)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        key = forwarded_key(request)
        choices: list[dict[str, Any]] = []
        for p, prompt in enumerate(document["prompt"]):
            offset = 1 if prompt == "b" else 0  # the second prompt's answers are longer
            for i in range(2):
                ids = ANSWERS[i + offset]
                publish_window(writer, prompt_key(key, p), i, len(ids))
                choices.append(
                    {
                        "index": len(choices),
                        "text": "x",
                        "finish_reason": "length",
                        "token_ids": ids,
                    }
                )
        reply = {"id": "cmpl", "object": "text_completion", "model": MODEL, "choices": choices}
        return httpx.Response(200, json=reply)

    vllm = FakeVLLM(handle)
    body = {
        "model": MODEL,
        "prompt": ["a", "b"],
        "n": 2,
        "kv_transfer_params": flagged()["kv_transfer_params"],
    }
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (sent,) = vllm.requests
    key = forwarded_key(sent)
    assert sent_document(sent)["return_token_ids"] is True
    merged = response.json()
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in merged["choices"]] == [None] * 4  # asked, taken out
    assert merged["kv_transfer_params"]["last_hidden_states"] == [
        expected_vector(prompt_key(key, 0), 0, 2),
        expected_vector(prompt_key(key, 0), 1, 3),
        expected_vector(prompt_key(key, 1), 0, 3),
        expected_vector(prompt_key(key, 1), 1, 4),
    ]


async def test_a_record_of_another_prompt_length_is_a_502(
    ring_dir: str, writer: RingWriter
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        publish(writer, answer_record(key, 0, 2))
        reply = json_reply(1, False)
        reply["usage"]["prompt_tokens"] = PROMPT_TOKENS + 1
        return httpx.Response(200, json=reply)

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 502
    assert f"after a {PROMPT_TOKENS + 1}-token prompt" in error_of(response)["message"]


@pytest.mark.parametrize(("name", "value"), [("echo", True), ("include_reasoning", False)])
async def test_what_would_hide_the_counts_of_several_choices_is_refused(
    ring_dir: str, writer: RingWriter, name: str, value: bool
) -> None:
    vllm = json_vllm(writer)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        refused = await proxy.client.post(CHAT, json=flagged(n=2, **{name: value}))
        single = await proxy.client.post(CHAT, json=flagged(**{name: value}))
    assert refused.status_code == 400 and error_of(refused)["param"] == name
    assert single.status_code == 200  # one choice: usage counts it, nothing is asked
    assert len(vllm.requests) == 1


async def test_a_last_chunk_without_its_count_ends_the_stream_with_a_502_event(
    ring_dir: str, writer: RingWriter
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        events = stream_events(1, continuous=False, usage=False)  # as if vLLM ignored the ask
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"".join(events)
        )

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(stream=True))
    received = data_of(response.text)
    assert received[-1]["error"]["code"] == 502
    assert "token count" in received[-1]["error"]["message"]
