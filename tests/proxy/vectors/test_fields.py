"""Joining records into vLLM's reply (proxy/vectors/fields.py, encoded by vectors/encoding.py): the
``kv_transfer_params`` fields, for the final layer, chosen layers and both poolings, in both
formats."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    HIDDEN_SIZE,
    LAYERED,
    AsgiCall,
    FakeVLLM,
    error_of,
    forwarded_key,
    proxy_client,
    publishing_handler,
    record_for,
    ring_shape,
    sent_document,
    settings_for,
    vector_bytes,
    vector_for,
)
from vllm_hidden_state_proxy.protocol import (
    BY_LAYER,
    DTYPE,
    INFO,
    INFOS,
    LAYERS_ENTRY,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    VECTOR,
    VECTORS,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.replies import send_joined, send_unchanged
from vllm_hidden_state_proxy.proxy.vectors.encoding import dump_json, encode_vector
from vllm_hidden_state_proxy.proxy.vectors.fields import (
    prompt_list_fields,
    single_prompt_fields,
    with_kv_fields,
)
from vllm_hidden_state_proxy.proxy.vectors.plan import resolve_layers
from vllm_hidden_state_proxy.request_fields import VectorRequest
from vllm_hidden_state_proxy.ring import RingWriter
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, vector_info

pytestmark = pytest.mark.anyio

KEY = bytes(range(1, 17))
CHAT = "/v1/chat/completions"


def wanted(
    layers: tuple[int, ...] | None = None,
    pooling: str = "last",
    fmt: str = "float",
    info: bool = False,
    dtype: str = "float32",
) -> WantedVectors:
    request = VectorRequest(fmt, info, layers, pooling, dtype)
    return resolve_layers(request, [ring_shape(LAYERED)])


def as_sent(fields: dict[str, Any]) -> Any:
    """The fields as a client reads them: the JSON the proxy writes, parsed."""
    return orjson.loads(dump_json(fields))


def decoded(value: str) -> list[float]:
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# ---------------------------------------------------------------------------------------------
# the fields, unit by unit
# ---------------------------------------------------------------------------------------------


def test_encode_vector_as_floats_or_base64() -> None:
    values = [1.5, -2.25, 0.0, 3e-3]
    raw = vector_bytes(values)
    floats = encode_vector(raw, "float")
    assert isinstance(floats, np.ndarray) and floats.dtype == np.float32
    assert floats.tobytes() == raw  # the ring's float32s as they are
    assert orjson.loads(dump_json({"v": floats})) == {"v": values}
    encoded = encode_vector(raw, "base64")
    assert isinstance(encoded, str) and base64.b64decode(encoded) == raw  # little-endian f32


def test_floats_read_back_bit_for_bit_as_float32_in_fewer_bytes() -> None:
    raw = np.random.default_rng(0).standard_normal(4096).astype("<f4").tobytes()
    text = dump_json({"v": encode_vector(raw, "float")})
    assert np.array(orjson.loads(text)["v"], dtype="<f4").tobytes() == raw
    widened = np.frombuffer(raw, dtype="<f4").tolist()  # each float32 as a Python float
    as_float64 = orjson.dumps({"v": widened})
    assert len(text) < 0.7 * len(as_float64)


def test_no_layers_asked_gives_the_final_layer_in_the_singular_field() -> None:
    record = record_for(KEY, (FINAL,))
    assert as_sent(single_prompt_fields(record, wanted())) == {VECTOR: vector_for(KEY)}


@pytest.mark.parametrize(
    ("asked", "absolute", "has_vector"),
    [
        ((-1,), (FINAL,), True),
        ((0, 2), (0, 2), False),
        ((2, 4), (2, 4), True),  # the final layer by its absolute index
        ((4, -1, 0), (4, FINAL, 0), True),
        ((-3, 2), (2, 2), False),  # two spellings of one layer: each keyed as written
    ],
)
def test_chosen_layers_are_keyed_as_written_in_the_request(
    asked: tuple[int, ...], absolute: tuple[int, ...], has_vector: bool
) -> None:
    resolved = wanted(asked, pooling="mean")
    assert resolved.layers == absolute
    record = record_for(KEY, resolved.distinct_layers, "mean")
    fields = as_sent(single_prompt_fields(record, resolved))
    by_layer = {
        str(label): vector_for(KEY, layer, "mean")
        for label, layer in zip(asked, absolute, strict=True)
    }
    assert fields[BY_LAYER] == by_layer
    assert list(fields[BY_LAYER]) == list(dict.fromkeys(str(label) for label in asked))
    assert (VECTOR in fields) is has_vector
    if has_vector:
        assert fields[VECTOR] == vector_for(KEY, FINAL, "mean")
    assert INFO not in fields


def test_base64_applies_to_every_vector() -> None:
    resolved = wanted((0, -1), fmt="base64")
    fields = as_sent(single_prompt_fields(record_for(KEY, (0, FINAL)), resolved))
    assert decoded(fields[VECTOR]) == vector_for(KEY)
    assert {label: decoded(value) for label, value in fields[BY_LAYER].items()} == {
        "0": vector_for(KEY, 0),
        "-1": vector_for(KEY),
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_values_come_with_their_dtype(dtype: str) -> None:
    """A bare base64 string does not say its dtype: read as float32, a 16-bit vector would
    be half as long and wrong, silently. The answer says it, once, beside the values."""
    resolved = wanted((0, -1), fmt="base64", dtype=dtype)
    single = as_sent(single_prompt_fields(record_for(KEY, (0, FINAL)), resolved))
    assert single[DTYPE] == dtype
    assert len(base64.b64decode(single[VECTOR])) == 2 * HIDDEN_SIZE
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    plural = as_sent(prompt_list_fields([record_for(k, (0, FINAL)) for k in keys], resolved))
    assert plural[DTYPE] == dtype and len(plural[VECTORS]) == 2
    float32 = single_prompt_fields(record_for(KEY, (0, FINAL)), wanted((0, -1), fmt="base64"))
    assert DTYPE not in float32  # a float32 answer is as it always was


def test_the_info_says_where_the_vectors_are_from() -> None:
    record = record_for(KEY, (FINAL,), position=6, num_prompt_tokens=7)
    assert vector_info(record, wanted()) == {
        "position": 6,
        "num_prompt_tokens": 7,
        "hidden_size": HIDDEN_SIZE,
        "dtype": "float32",
        "pooling": "last",
        "layer": "final_norm",
    }
    mean = record_for(KEY, (0, 2), "mean")
    info = vector_info(mean, wanted((0, -3), pooling="mean"))
    assert info["pooling"] == "mean"
    assert info["layers"] == [0, -3]  # as written
    assert "layer" not in info  # the final layer was not asked for
    with_final = vector_info(record_for(KEY, (2, FINAL)), wanted((2, -1), info=True))
    assert (with_final["layer"], with_final["layers"]) == ("final_norm", [2, -1])
    fields = single_prompt_fields(record_for(KEY, (2, FINAL)), wanted((2, -1), info=True))
    assert fields[INFO] == with_final


def test_a_prompt_list_gets_the_plural_fields_in_prompt_order() -> None:
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    plain = as_sent(prompt_list_fields([record_for(k) for k in keys], wanted(info=True)))
    assert plain[VECTORS] == [vector_for(k) for k in keys]
    assert [i["position"] for i in plain[INFOS]] == [4, 4, 4]
    assert BY_LAYER not in plain and VECTOR not in plain
    layered = as_sent(
        prompt_list_fields([record_for(k, (0, FINAL)) for k in keys], wanted((0, -1)))
    )
    assert layered[VECTORS] == [vector_for(k) for k in keys]
    assert layered[BY_LAYER] == [{"0": vector_for(k, 0), "-1": vector_for(k)} for k in keys]
    without_final = prompt_list_fields([record_for(k, (2,)) for k in keys], wanted((2,)))
    assert set(without_final) == {BY_LAYER}


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (None, {VECTOR: [1.5]}),
        ("junk", {VECTOR: [1.5]}),
        ({"a": 1}, {"a": 1, VECTOR: [1.5]}),
        ({VECTOR: "stale"}, {VECTOR: [1.5]}),
    ],
)
def test_with_kv_fields(kv: Any, expected: dict[str, Any]) -> None:
    document = {"id": "x", "kv_transfer_params": kv}
    assert with_kv_fields(document, {VECTOR: [1.5]}) == {"id": "x", "kv_transfer_params": expected}
    assert document == {"id": "x", "kv_transfer_params": kv}  # not changed in place


# ---------------------------------------------------------------------------------------------
# whole responses
# ---------------------------------------------------------------------------------------------


async def test_send_joined_rebuilds_the_headers() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    upstream = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", b"999"),
        (b"content-encoding", b"gzip"),
        (b"x-request-id", b"r1"),
        (b"connection", b"close"),
    ]
    await send_joined(call.send, upstream, {"id": "x"}, {VECTOR: [1.0]})
    start, body = call.messages
    assert start["status"] == 200
    assert body["body"] == b'{"id":"x","kv_transfer_params":{"last_hidden_state":[1.0]}}'
    assert sorted(start["headers"]) == sorted(
        [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body["body"])).encode()),
            (b"x-request-id", b"r1"),
        ]
    )


async def test_send_joined_of_a_reply_too_deep_to_write_is_502() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    deep: Any = 0
    for _ in range(300):
        deep = [deep]
    with pytest.raises(ProxyError) as caught:
        await send_joined(call.send, [], {"x": deep}, {VECTOR: [1.0]})
    assert caught.value.status == 502
    assert call.messages == []


async def test_send_unchanged_keeps_vllms_content_type() -> None:
    call = AsgiCall(lambda *args: None)  # type: ignore[arg-type]
    await send_unchanged(call.send, 422, [(b"Content-Type", b"text/plain")], b"no")
    start, body = call.messages
    assert start["status"] == 422 and body["body"] == b"no"
    assert (b"content-type", b"text/plain") in start["headers"]


# ---------------------------------------------------------------------------------------------
# through the app: chat with layers and poolings
# ---------------------------------------------------------------------------------------------


def flagged(**kv: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"return_last_hidden_state": True, **kv},
    }


async def ask(
    ring_dir: str, writer: RingWriter, body: dict[str, Any]
) -> tuple[dict[str, Any], httpx.Request]:
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    kv: dict[str, Any] = response.json()["kv_transfer_params"]
    return kv, forwarded


async def test_chosen_layers_through_chat(ring_dir: str, layered_writer: RingWriter) -> None:
    kv, forwarded = await ask(
        ring_dir, layered_writer, flagged(last_hidden_state_layers=[2, 0, -1])
    )
    key = forwarded_key(forwarded)
    assert kv == {
        VECTOR: vector_for(key),
        BY_LAYER: {"2": vector_for(key, 2), "0": vector_for(key, 0), "-1": vector_for(key)},
    }
    assert sent_document(forwarded)["vllm_xargs"] == {
        REQUEST_KEY_ENTRY: key.hex(),
        LAYERS_ENTRY: [0, 2, 4],
    }


async def test_layers_without_the_final_one_leave_out_the_singular_field(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    kv, forwarded = await ask(
        ring_dir,
        layered_writer,
        flagged(last_hidden_state_layers=[0], last_hidden_state_format="base64"),
    )
    key = forwarded_key(forwarded)
    assert set(kv) == {BY_LAYER}
    assert decoded(kv[BY_LAYER]["0"]) == vector_for(key, 0)


async def test_mean_pooling_through_chat(ring_dir: str, layered_writer: RingWriter) -> None:
    kv, forwarded = await ask(
        ring_dir,
        layered_writer,
        flagged(
            last_hidden_state_layers=[4],
            last_hidden_state_pooling="mean",
            last_hidden_state_info=True,
        ),
    )
    key = forwarded_key(forwarded)
    assert kv[VECTOR] == vector_for(key, FINAL, "mean")
    assert kv[BY_LAYER] == {"4": vector_for(key, FINAL, "mean")}
    assert kv[INFO] == {
        "position": 4,
        "num_prompt_tokens": 5,
        "hidden_size": HIDDEN_SIZE,
        "dtype": "float32",
        "pooling": "mean",
        "layer": "final_norm",
        "layers": [4],
    }
    sent = sent_document(forwarded)
    assert sent["vllm_xargs"] == {REQUEST_KEY_ENTRY: key.hex(), POOLING_ENTRY: "mean"}
    assert isinstance(sent["cache_salt"], str) and len(sent["cache_salt"]) == 32


async def test_a_plain_request_is_unchanged_by_a_layered_server(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    """Existing clients see no difference: one field, the final layer, nothing more asked."""
    kv, forwarded = await ask(ring_dir, layered_writer, flagged())
    key = forwarded_key(forwarded)
    assert kv == {VECTOR: vector_for(key)}
    assert sent_document(forwarded)["vllm_xargs"] == {REQUEST_KEY_ENTRY: key.hex()}
    assert "cache_salt" not in sent_document(forwarded)


@pytest.mark.parametrize(
    ("published", "asked", "message"),
    [
        (
            ((FINAL,), "last"),
            {"last_hidden_state_layers": [0, -1]},
            "published layers 4 (last pooling) for this request, which asked for layers 0, 4 "
            "(last pooling)",
        ),
        (
            ((FINAL,), "last"),
            {"last_hidden_state_pooling": "mean"},
            "published layers 4 (last pooling) for this request, which asked for layers 4 "
            "(mean pooling)",
        ),
    ],
    ids=["layer-missing", "pooling-ignored"],
)
async def test_a_record_that_is_not_what_was_asked_is_never_a_wrong_answer(
    ring_dir: str,
    layered_writer: RingWriter,
    published: tuple[tuple[int, ...], str],
    asked: dict[str, Any],
    message: str,
) -> None:
    """A hook of another release publishes the final layer, pooled "last", whatever the
    request asked: a 502 that says so, never a 200 with a wrong vector, never a crash."""
    layers, pooling = published

    async def handle(request: httpx.Request) -> httpx.Response:
        record = record_for(forwarded_key(request), layers, pooling)
        layered_writer.publish(
            record.key, bytes(record.vectors), position=1, num_prompt_tokens=2, layers=layers
        )
        return httpx.Response(200, content=orjson.dumps({"choices": []}))

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(CHAT, json=flagged(**asked))
    assert response.status_code == 502, response.text
    error = error_of(response)
    assert message in error["message"]
    assert "different releases" in error["message"]
