"""``POST /v1/embeddings`` (proxy/endpoints/embeddings.py): inputs fanned out as flagged one-token
requests, vectors in input order (normalised, as floats or base64), layer and pooling."""

from __future__ import annotations

import base64
import math
import struct

import anyio
import httpx
import numpy as np
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    HIDDEN_SIZE,
    LAYERED,
    MODEL,
    FakeRing,
    FakeVLLM,
    Hook,
    error_of,
    forwarded_key,
    proxy_client,
    publish_for,
    sent_document,
    settings_for,
    vector_bytes,
    vector_for,
)
from vllm_hidden_state_proxy.protocol import LAYERS_ENTRY, POOLING_ENTRY, REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.proxy.endpoints.embeddings import embedding_of, input_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.keyed_request import UnchangedReply
from vllm_hidden_state_proxy.ring import Record, RingWriter

pytestmark = pytest.mark.anyio

EMBEDDINGS = "/v1/embeddings"


class ChatAndCompletionsVLLM:
    """Publishes a record per request after a small delay (answers finish out of order); fails
    inputs containing 'fail'."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self.keys: list[tuple[str, bytes]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        document = sent_document(request)
        text = str(document.get("messages") or document.get("prompt"))
        if "fail" in text:
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        await anyio.sleep((hash(text) % 5) / 1000)
        self.keys.append((text, publish_for(self.hook, request)))
        return httpx.Response(200, json={"id": "c", "model": "served-name", "choices": []})

    def key_for(self, fragment: str) -> bytes:
        (key,) = [key for text, key in self.keys if fragment in text]
        return key


def unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def decoded(value: str) -> list[float]:
    return list(struct.unpack(f"<{HIDDEN_SIZE}f", base64.b64decode(value)))


async def test_inputs_in_order_normalised_with_usage(ring_dir: str, writer: RingWriter) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    texts = [f"text number {i}" for i in range(12)]
    async with proxy_client(settings_for(ring_dir, fan_out_limit=3), FakeVLLM(vllm)) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"model": "m", "input": texts})
        assert proxy.metrics.requests["embeddings"] == 1
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "served-name"
    assert body["usage"] == {"prompt_tokens": 5 * 12, "total_tokens": 5 * 12}
    assert [item["index"] for item in body["data"]] == list(range(12))
    for text, item in zip(texts, body["data"], strict=True):
        assert item["object"] == "embedding"
        expected = unit(vector_for(vllm.key_for(f'"{text}"')))  # quoted by the template
        # float32 values (a float32 ulp is 1.2e-7 relative), each written as its shortest decimal
        assert item["embedding"] == pytest.approx(expected, rel=2.5e-7)


async def test_base64_and_unnormalised(ring_dir: str, writer: RingWriter) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(vllm)) as proxy:
        raw = await proxy.client.post(
            EMBEDDINGS, json={"input": [[1, 2]], "normalize": False, "encoding_format": "base64"}
        )
        normed = await proxy.client.post(
            EMBEDDINGS, json={"input": [[1, 2]], "encoding_format": "base64"}
        )
    first, second = (key for _, key in vllm.keys)
    assert decoded(raw.json()["data"][0]["embedding"]) == vector_for(first)
    assert decoded(normed.json()["data"][0]["embedding"]) == pytest.approx(
        unit(vector_for(second)), rel=1e-6
    )


async def test_a_chosen_layer_and_mean_pooling(ring_dir: str, layered_writer: RingWriter) -> None:
    vllm = ChatAndCompletionsVLLM(layered_writer)
    fake = FakeVLLM(vllm)
    async with proxy_client(settings_for(ring_dir), fake) as proxy:
        response = await proxy.client.post(
            EMBEDDINGS,
            json={"input": ["a", "b"], "layer": 0, "pooling": "mean", "normalize": False},
        )
    assert response.status_code == 200, response.text
    embeddings = [item["embedding"] for item in response.json()["data"]]
    assert embeddings == [
        vector_for(vllm.key_for('"a"'), 0, "mean"),
        vector_for(vllm.key_for('"b"'), 0, "mean"),
    ]
    salts = set()
    for request in fake.requests:
        sent = sent_document(request)
        assert set(sent["vllm_xargs"]) == {REQUEST_KEY_ENTRY, LAYERS_ENTRY, POOLING_ENTRY}
        assert (sent["vllm_xargs"][LAYERS_ENTRY], sent["vllm_xargs"][POOLING_ENTRY]) == (
            [0],
            "mean",
        )
        salts.add(sent["cache_salt"])
    assert len(salts) == 2  # a fresh salt per input: no prefix cache


async def test_the_servers_default_layer_and_pooling(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    vllm = ChatAndCompletionsVLLM(layered_writer)
    settings = settings_for(ring_dir, embedding_layer=2, embedding_pooling="mean")
    async with proxy_client(settings, FakeVLLM(vllm)) as proxy:
        default = await proxy.client.post(EMBEDDINGS, json={"input": "d", "normalize": False})
        final = await proxy.client.post(
            EMBEDDINGS, json={"input": "f", "normalize": False, "layer": -1, "pooling": "last"}
        )
    assert default.json()["data"][0]["embedding"] == vector_for(vllm.key_for('"d"'), 2, "mean")
    assert final.json()["data"][0]["embedding"] == vector_for(vllm.key_for('"f"'), FINAL)


async def test_a_layer_the_server_does_not_capture_is_400_naming_layer(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    vllm = FakeVLLM(ChatAndCompletionsVLLM(layered_writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": "a", "layer": 1})
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "layer"
    assert f"captures layers {', '.join(map(str, LAYERED))}" in error["message"]
    assert vllm.requests == []


async def test_a_failing_input_fails_the_request_naming_its_index(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = ChatAndCompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(vllm)) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": ["ok", "ok", "fail", "ok"]})
        messages = await proxy.client.post(
            EMBEDDINGS, json={"messages": [{"role": "user", "content": "fail"}]}
        )
    assert response.status_code == 400
    error = error_of(response)
    assert (error["message"], error["param"]) == ("input[2]: too long", "input")
    assert error_of(messages)["message"] == "messages: too long"


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("normalize", [True, False])
async def test_a_non_finite_hidden_state_is_502_not_an_embedding(
    bad: float, normalize: bool
) -> None:
    """An fp16 overflow: JSON would write it as null, and the unit vector would be all NaN."""
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        text = str(sent_document(request)["messages"])
        values = [1.0] * HIDDEN_SIZE
        values[-1] = bad if "second" in text else 1.0
        ring.publish(Record(key, MODEL, 4, 5, "last", (FINAL,), HIDDEN_SIZE, vector_bytes(values)))
        return httpx.Response(200, json={"id": "c", "model": "m", "choices": []})

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        body = {"input": ["first", "second"], "normalize": normalize}
        response = await proxy.client.post(EMBEDDINGS, json=body)
        assert (await proxy.client.post(EMBEDDINGS, json={"input": ["first"]})).status_code == 200
    assert response.status_code == 502
    error = error_of(response)
    assert error["message"].startswith("input[1]: the model's hidden state holds NaN or infinity")
    assert error["param"] == "input"


async def test_a_default_layer_the_server_does_not_capture_is_503_naming_the_option(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    """--embedding-layer names a layer vLLM was not started to capture: the operator's mistake,
    so not a 400 blaming the client's (absent) 'layer'."""
    vllm = FakeVLLM(ChatAndCompletionsVLLM(layered_writer))
    async with proxy_client(settings_for(ring_dir, embedding_layer=1), vllm) as proxy:
        default = await proxy.client.post(EMBEDDINGS, json={"input": "a"})
        given = await proxy.client.post(EMBEDDINGS, json={"input": "a", "layer": 1})
        chosen = await proxy.client.post(EMBEDDINGS, json={"input": "a", "layer": 0})
    assert default.status_code == 503
    error = error_of(default)
    assert error["param"] is None
    assert error["message"].startswith("This server's default embedding layer (--embedding-layer)")
    assert f"captures layers {', '.join(map(str, LAYERED))}" in error["message"]
    assert (given.status_code, error_of(given)["param"]) == (400, "layer")
    assert chosen.status_code == 200
    assert len(vllm.requests) == 1  # only the request with a captured layer reached vLLM


async def test_dimensions_must_equal_the_hidden_size(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(ChatAndCompletionsVLLM(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        wrong = await proxy.client.post(EMBEDDINGS, json={"input": "a", "dimensions": 4})
        right = await proxy.client.post(EMBEDDINGS, json={"input": "a", "dimensions": HIDDEN_SIZE})
    assert wrong.status_code == 400
    assert "Matryoshka" in error_of(wrong)["message"]
    assert len(vllm.requests) == 1
    assert len(right.json()["data"][0]["embedding"]) == HIDDEN_SIZE


async def test_too_many_inputs_is_400_before_any_vllm_request(ring_dir: str) -> None:
    async def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request may reach vLLM")

    vllm = FakeVLLM(never)
    async with proxy_client(settings_for(ring_dir, max_embedding_inputs=2), vllm) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": ["a", "b", "c"]})
    assert response.status_code == 400
    assert "at most 2" in error_of(response)["message"]
    assert vllm.requests == []


async def test_no_ring_is_503(ring_dir: str) -> None:
    vllm = FakeVLLM(ChatAndCompletionsVLLM(None))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(EMBEDDINGS, json={"input": "a"})
    assert response.status_code == 503
    assert vllm.requests == []


async def test_deep_messages_are_400_naming_messages(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(ChatAndCompletionsVLLM(writer))
    deep = b"[" * 1000 + b"]" * 1000
    body = b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(EMBEDDINGS, content=body)
    assert response.status_code == 400
    error = error_of(response)
    assert "nested" in error["message"] and error["param"] == "messages"
    assert vllm.requests == []


async def test_the_flag_is_not_needed_and_an_invalid_body_is_400(ring_dir: str) -> None:
    async with proxy_client(settings_for(ring_dir), FakeVLLM(ChatAndCompletionsVLLM(None))) as p:
        response = await p.client.post(EMBEDDINGS, content=b"[1, 2]")
    assert response.status_code == 400


# ---------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------


def test_embedding_of() -> None:
    raw = vector_bytes([3.0, 4.0])
    floats, normed_floats = embedding_of(raw, False, "float"), embedding_of(raw, True, "float")
    assert isinstance(floats, np.ndarray) and isinstance(normed_floats, np.ndarray)
    assert floats.dtype == normed_floats.dtype == np.float32
    assert floats.tolist() == [3.0, 4.0]
    assert normed_floats.tolist() == pytest.approx([0.6, 0.8])
    assert base64.b64decode(embedding_of(raw, False, "base64")) == raw  # type: ignore[arg-type]
    normed = base64.b64decode(embedding_of(raw, True, "base64"))  # type: ignore[arg-type]
    assert struct.unpack("<2f", normed) == pytest.approx((0.6, 0.8))
    zeros = embedding_of(vector_bytes([0.0, 0.0]), True, "float")
    assert isinstance(zeros, np.ndarray) and zeros.tolist() == [0.0, 0.0]  # no 0/0


def test_input_error_names_the_input() -> None:
    vllm_json = UnchangedReply(400, [], orjson.dumps({"error": {"message": "too long"}}))
    assert input_error(3, "input", vllm_json).message == "input[3]: too long"
    plain = UnchangedReply(500, [], b"Internal Server Error")
    error = input_error(0, "input", plain)
    assert (error.status, error.message, error.param) == (
        500,
        "input[0]: Internal Server Error",
        "input",
    )
    proxy_error = input_error(1, "input", ProxyError(504, "timed out"))
    assert (proxy_error.status, proxy_error.message) == (504, "input[1]: timed out")
    named = input_error(0, "messages", ProxyError(400, "nested", "x"))
    assert (named.message, named.param) == ("messages: nested", "x")
    odd = input_error(0, "input", UnchangedReply(400, [], b'["not", "an", "object"]'))
    assert odd.message == 'input[0]: ["not", "an", "object"]'


def test_input_error_keeps_vllms_type_and_param() -> None:
    body = {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError"}}
    body["error"]["param"] = "model"
    error = input_error(2, "input", UnchangedReply(404, [], orjson.dumps(body)))
    assert (error.status, error.param, error.kind) == (404, "model", "NotFoundError")
    assert orjson.loads(error.body())["error"] == {
        "message": "input[2]: The model `x` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


@pytest.mark.parametrize(
    "vllms",
    ["input_tokens", "max_completion_tokens", "prompt", "messages", "chat_template_kwargs", None],
)
def test_vllms_param_for_the_built_request_names_the_input(vllms: str | None) -> None:
    """vLLM names the fields of the request the proxy built (a prompt too long is
    ``input_tokens``; a text's chat is the proxy's ``messages``); the client sent ``input``."""
    body = {"error": {"message": "too long", "type": "BadRequestError", "param": vllms}}
    error = input_error(1, "input", UnchangedReply(400, [], orjson.dumps(body)))
    assert (error.param, error.kind, error.message) == (
        "input",
        "BadRequestError",
        "input[1]: too long",
    )


def test_vllms_param_naming_a_field_of_the_chat_form_is_kept() -> None:
    body = {"error": {"message": "bad", "type": "BadRequestError", "param": "chat_template_kwargs"}}
    error = input_error(0, "messages", UnchangedReply(400, [], orjson.dumps(body)))
    assert (error.param, error.message) == ("chat_template_kwargs", "messages: bad")
