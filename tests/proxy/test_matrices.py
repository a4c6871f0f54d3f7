"""Matrices in the proxy (poolings "all_prompt" and "all_answer"): the matrix object joined
into vLLM's answer (base64 by default, lists or 16-bit values on request), all_answer's rows cut
to each choice's token count, the hook's 413/503 kept, and what is refused before sending."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import numpy as np
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
)
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    MAX_RECORD_MIB_ENV,
    MAX_SPANS,
    POOLING_ENTRY,
    SPANS_ENTRY,
    SPANS_POOLING,
    all_answer_key,
)
from vllm_hidden_state_proxy.ring import ErrorRecord, Record, RingWriter
from vllm_hidden_state_proxy.ring.layout import arena_block_size
from vllm_hidden_state_proxy.wanted_vectors import as_dtype

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 6
ANSWERS = [[11, 12], [21, 22, 23]]


def rows_for(key: bytes, rows: int, salt: int = 0) -> bytes:
    values = np.random.default_rng(int.from_bytes(key[:4], "little") + salt)
    return values.standard_normal(rows * HIDDEN_SIZE).astype("<f4").tobytes()


def flagged(pooling: str, **extra: Any) -> dict[str, Any]:
    kv: dict[str, Any] = {"return_last_hidden_state": True, "last_hidden_state_pooling": pooling}
    kv.update(extra.pop("kv", {}))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
        "kv_transfer_params": kv,
    }


def completion(n: int, with_ids: bool) -> dict[str, Any]:
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
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": 8},
        "prompt_token_ids": list(range(PROMPT_TOKENS)) if with_ids else None,
    }


def vllm_publishing(
    hook: RingWriter, *, extra_rows: int = 1, error: ErrorRecord | None = None
) -> FakeVLLM:
    """vLLM whose hook publishes a prompt matrix, or each choice's answer matrix (with
    ``extra_rows`` computed past the stop)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        key = forwarded_key(request)
        n = int(document.get("n") or 1)
        pooling = document["vllm_xargs"][POOLING_ENTRY]
        if error is not None:
            publish(hook, ErrorRecord(key, error.message, error.status))
        elif pooling == "all_prompt":
            publish(
                hook,
                Record(
                    key,
                    MODEL,
                    0,
                    PROMPT_TOKENS,
                    pooling,
                    (FINAL,),
                    HIDDEN_SIZE,
                    rows_for(key, PROMPT_TOKENS),
                    PROMPT_TOKENS,
                ),
            )
        else:
            for i in range(n):
                rows = len(ANSWERS[i]) + extra_rows
                publish(
                    hook,
                    Record(
                        all_answer_key(key, i),
                        MODEL,
                        PROMPT_TOKENS - 1,
                        PROMPT_TOKENS,
                        pooling,
                        (FINAL,),
                        HIDDEN_SIZE,
                        rows_for(key, rows, i),
                        rows,
                    ),
                )
        return httpx.Response(200, json=completion(n, document.get("return_token_ids") is True))

    return FakeVLLM(handle)


def matrix_rows(matrix: dict[str, Any]) -> bytes:
    assert matrix["dtype"] == "float32"
    return base64.b64decode(matrix["data"])


async def test_all_prompt_is_a_base64_matrix_of_every_prompt_row(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = vllm_publishing(writer)
    body = flagged("all_prompt", kv={"last_hidden_state_info": True})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    sent, key = sent_document(forwarded), forwarded_key(forwarded)
    assert sent["vllm_xargs"][POOLING_ENTRY] == "all_prompt"
    assert len(sent["cache_salt"]) == 32  # every position computed: the cache is skipped
    kv = response.json()["kv_transfer_params"]
    matrix = kv["last_hidden_state"]
    assert matrix["shape"] == [PROMPT_TOKENS, HIDDEN_SIZE]
    assert matrix_rows(matrix) == rows_for(key, PROMPT_TOKENS)
    info = kv["last_hidden_state_info"]
    assert (info["pooling"], info["rows"], info["position"]) == ("all_prompt", PROMPT_TOKENS, 0)


async def test_lists_of_rows_on_request(ring_dir: str, writer: RingWriter) -> None:
    vllm = vllm_publishing(writer)
    body = flagged("all_prompt", kv={"last_hidden_state_format": "float"})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    matrix = response.json()["kv_transfer_params"]["last_hidden_state"]
    key = forwarded_key(vllm.requests[0])
    want = np.frombuffer(rows_for(key, PROMPT_TOKENS), "<f4").reshape(PROMPT_TOKENS, HIDDEN_SIZE)
    assert np.array_equal(np.asarray(matrix["data"], dtype=np.float32), want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_16_bit_values_on_request(ring_dir: str, writer: RingWriter, dtype: str) -> None:
    vllm = vllm_publishing(writer)
    body = flagged("all_prompt", kv={"last_hidden_state_dtype": dtype})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    kv = response.json()["kv_transfer_params"]
    matrix = kv["last_hidden_state"]
    assert matrix["dtype"] == kv["last_hidden_state_dtype"] == dtype
    key = forwarded_key(vllm.requests[0])
    assert base64.b64decode(matrix["data"]) == as_dtype(rows_for(key, PROMPT_TOKENS), dtype)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nans() -> None:
    def bits(value: float) -> int:
        raw: int = struct.unpack("<I", struct.pack("<f", value))[0]
        return raw

    cases = {
        1.0: 0x3F80,
        bits_to_float(0x3F808000): 0x3F80,  # a tie: to the even neighbour
        bits_to_float(0x3F818000): 0x3F82,  # a tie: to the even neighbour (up)
        bits_to_float(0x3F808001): 0x3F81,  # past the tie: up
        float("inf"): 0x7F80,
        float("-inf"): 0xFF80,
    }
    for value, want in cases.items():
        got = struct.unpack("<H", as_dtype(struct.pack("<f", value), "bfloat16"))[0]
        assert got == want, (hex(bits(value)), hex(got))
    nan = struct.unpack("<H", as_dtype(struct.pack("<I", 0x7FFFFFFF), "bfloat16"))[0]
    assert nan & 0x7F80 == 0x7F80 and nan & 0x7F  # still a NaN, not an infinity
    half = as_dtype(struct.pack("<2f", 1.5, -2.0), "float16")
    assert np.frombuffer(half, "<f2").tolist() == [1.5, -2.0]


def bits_to_float(raw: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", raw))[0]
    return value


@pytest.mark.parametrize(
    ("kv", "param"),
    [
        ({"last_hidden_state_dtype": "float64"}, "kv_transfer_params.last_hidden_state_dtype"),
        (
            {"last_hidden_state_dtype": "float16", "last_hidden_state_format": "float"},
            "kv_transfer_params.last_hidden_state_dtype",
        ),
        (
            {"last_hidden_state_pooling": "all_tokens"},
            "kv_transfer_params.last_hidden_state_pooling",
        ),
    ],
)
async def test_bad_matrix_options_are_400s(
    ring_dir: str, writer: RingWriter, kv: dict[str, Any], param: str
) -> None:
    vllm = vllm_publishing(writer)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged("all_prompt", kv=kv))
    assert response.status_code == 400
    assert error_of(response)["param"] == param
    assert vllm.requests == []


@pytest.mark.parametrize("n", [1, 2])
async def test_all_answer_keeps_as_many_rows_as_each_choice_has_tokens(
    ring_dir: str, writer: RingWriter, n: int
) -> None:
    vllm = vllm_publishing(writer, extra_rows=2)
    body = flagged("all_answer", n=n, kv={"last_hidden_state_info": True})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    key = forwarded_key(vllm.requests[0])
    kv = response.json()["kv_transfer_params"]
    matrices = kv["last_hidden_states"] if n > 1 else [kv["last_hidden_state"]]
    infos = kv["last_hidden_state_infos"] if n > 1 else [kv["last_hidden_state_info"]]
    for i, (matrix, info) in enumerate(zip(matrices, infos, strict=True)):
        count = len(ANSWERS[i]) if n > 1 else 2  # one choice: usage's completion_tokens
        assert matrix["shape"] == [count, HIDDEN_SIZE]
        full = rows_for(key, count + 2, i)
        assert matrix_rows(matrix) == full[: count * HIDDEN_SIZE * 4]
        assert (info["rows"], info["num_output_tokens"]) == (count, count)
        assert info["position"] == PROMPT_TOKENS - 1


async def test_an_answer_matrix_with_too_few_rows_is_a_502(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = vllm_publishing(writer, extra_rows=-1)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged("all_answer"))
    assert response.status_code == 502
    assert "disagree" in error_of(response)["message"]


@pytest.mark.parametrize("status", [413, 503])
async def test_the_hooks_limits_keep_their_status(
    ring_dir: str, writer: RingWriter, status: int
) -> None:
    error = ErrorRecord(b"", f"past {MAX_RECORD_MIB_ENV}", status)
    vllm = vllm_publishing(writer, error=error)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged("all_prompt"))
    assert response.status_code == status
    assert MAX_RECORD_MIB_ENV in error_of(response)["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_an_answer_matrix_past_the_max_record_is_refused_before_sending(
    ring_dir: str, field: str
) -> None:
    with create_writer(ring_dir, arena_size=1 << 16, max_record=4096) as writer:
        vllm = vllm_publishing(writer)
        # The first row count whose block (header included) is past the max record.
        rows = next(n for n in range(1, 4096) if arena_block_size(4 * HIDDEN_SIZE * n) > 4096)
        async with proxy_client(settings_for(ring_dir), vllm) as proxy:
            response = await proxy.client.post(CHAT, json=flagged("all_answer", **{field: rows}))
            fits = await proxy.client.post(CHAT, json=flagged("all_answer", **{field: rows - 1}))
    assert response.status_code == 413
    error = error_of(response)
    assert error["param"] == field and MAX_RECORD_MIB_ENV in error["message"]
    assert fits.status_code == 200, fits.text
    assert len(vllm.requests) == 1


async def test_a_server_without_an_arena_refuses_matrices_before_sending(ring_dir: str) -> None:
    with create_writer(ring_dir, arena_size=0) as writer:
        vllm = vllm_publishing(writer)
        async with proxy_client(settings_for(ring_dir), vllm) as proxy:
            response = await proxy.client.post(CHAT, json=flagged("all_prompt"))
    assert response.status_code == 503
    assert ARENA_MIB_ENV in error_of(response)["message"]
    assert vllm.requests == []


def spans_vllm(hook: RingWriter) -> FakeVLLM:
    async def handle(request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        key = forwarded_key(request)
        spans = document["vllm_xargs"][SPANS_ENTRY]
        pooling = document["vllm_xargs"][POOLING_ENTRY]
        rows = len(spans) // 2
        publish(
            hook,
            Record(
                key,
                MODEL,
                0,
                PROMPT_TOKENS,
                pooling,
                (FINAL,),
                HIDDEN_SIZE,
                rows_for(key, rows),
                rows,
            ),
        )
        return httpx.Response(200, json=completion(1, False))

    return FakeVLLM(handle)


async def test_spans_are_sent_to_the_hook_and_come_back_one_row_each(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = spans_vllm(writer)
    spans = [[0, 3], [2, 6]]
    body = flagged("mean", kv={"last_hidden_state_spans": spans, "last_hidden_state_info": True})
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    sent = sent_document(vllm.requests[0])
    assert sent["vllm_xargs"][POOLING_ENTRY] == SPANS_POOLING
    assert sent["vllm_xargs"][SPANS_ENTRY] == [0, 3, 2, 6]  # flat: vLLM takes no nested lists
    assert "cache_salt" in sent
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_state"]["shape"] == [2, HIDDEN_SIZE]
    key = forwarded_key(vllm.requests[0])
    assert matrix_rows(kv["last_hidden_state"]) == rows_for(key, 2)
    info = kv["last_hidden_state_info"]
    assert (info["pooling"], info["spans"], info["rows"]) == ("mean", spans, 2)


@pytest.mark.parametrize(
    "kv",
    [
        {"last_hidden_state_spans": []},
        {"last_hidden_state_spans": [[2, 2]]},
        {"last_hidden_state_spans": [[-1, 2]]},
        {"last_hidden_state_spans": [[0, 1, 2]]},
        {"last_hidden_state_spans": [[0, 1.5]]},
        {"last_hidden_state_spans": "0:4"},
        {"last_hidden_state_spans": [[0, 1]] * (MAX_SPANS + 1)},
        {"last_hidden_state_spans": [[0, 1]], "last_hidden_state_pooling": "last"},
        {"last_hidden_state_spans": [[0, 1]], "last_hidden_state_pooling": "all_prompt"},
    ],
)
async def test_bad_spans_are_400s(ring_dir: str, writer: RingWriter, kv: dict[str, Any]) -> None:
    vllm = spans_vllm(writer)
    body = flagged("mean", kv=kv)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 400
    assert error_of(response)["param"] == "kv_transfer_params.last_hidden_state_spans"
    assert vllm.requests == []


async def test_spans_without_a_pooling_are_mean_pooled(ring_dir: str, writer: RingWriter) -> None:
    vllm = spans_vllm(writer)
    body = flagged("mean", kv={"last_hidden_state_spans": [[1, 2]]})
    del body["kv_transfer_params"]["last_hidden_state_pooling"]
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer_params"]["last_hidden_state"]["shape"] == [1, HIDDEN_SIZE]
