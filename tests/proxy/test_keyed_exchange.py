"""One keyed request to vLLM (proxy/keyed_exchange.py): a fresh request key in, vLLM's answer
and the record out; never a 200 without the vector."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    LAYERED,
    AsgiCall,
    FakeRing,
    FakeVLLM,
    completion,
    error_of,
    forwarded_key,
    proxy_client,
    publish_for,
    publishing_handler,
    record_for,
    ring_shape,
    running,
    settings_for,
    vector_for,
)
from vllm_hidden_state_proxy.protocol import (
    KV,
    LAYERS_ENTRY,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    request_key_from_wire,
)
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import Flagged, inspect_body
from vllm_hidden_state_proxy.proxy.keyed_exchange import (
    fetch_keyed_json,
    is_event_stream,
)
from vllm_hidden_state_proxy.proxy.keyed_request import (
    JoinableReply,
    KeyedRequest,
    ReplyBudget,
    UnchangedReply,
    keyed_body,
)
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.events import json_object
from vllm_hidden_state_proxy.proxy.vectors.plan import resolve_layers
from vllm_hidden_state_proxy.request_fields import VectorRequest
from vllm_hidden_state_proxy.ring import Found, RingWriter
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]
WIRE = "ab" * 16


def flagged(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "kv_transfer_params": {"return_last_hidden_state": True},
    }
    body.update(extra)
    return body


# ---------------------------------------------------------------------------------------------
# the happy path, with a real ring
# ---------------------------------------------------------------------------------------------


async def test_the_request_gets_a_fresh_key_and_its_own_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(publishing_handler(writer, response_kv={"remote_engine_id": "e1"}))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(
            CHAT,
            json=flagged(max_tokens=1, vllm_xargs={"mine": 7}),
            headers={"x-request-id": "r1", "accept-encoding": "gzip"},
        )
        metrics = proxy.metrics
        assert metrics.requests == {"ordinary": 0, "flagged": 1, "embeddings": 0}
        assert metrics.flagged_received == 1
        assert metrics.vector_wait.count == 1

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    (forwarded,) = vllm.requests
    key = forwarded_key(forwarded)
    body = response.json()
    assert body["kv_transfer_params"] == {
        "remote_engine_id": "e1",
        "last_hidden_state": vector_for(key),
    }
    assert body["choices"] == completion()["choices"]

    sent = orjson.loads(forwarded.content)
    assert "kv_transfer_params" not in sent  # emptied by stripping the flag: dropped
    assert (sent["messages"], sent["max_tokens"], sent["model"]) == (MESSAGES, 1, "m")
    assert sent["vllm_xargs"] == {"mine": 7, REQUEST_KEY_ENTRY: key.hex()}
    assert "cache_salt" not in sent
    assert forwarded.headers["content-length"] == str(len(forwarded.content))
    assert forwarded.headers["x-request-id"] == "r1"
    assert "accept-encoding" not in forwarded.headers  # the proxy reads the body
    assert forwarded.url.path == CHAT


async def test_each_request_gets_its_own_key_and_vector(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        responses = await asyncio.gather(
            *(proxy.client.post(CHAT, json=flagged()) for _ in range(5))
        )
    keys = {forwarded_key(request) for request in vllm.requests}
    assert len(keys) == 5
    vectors = [r.json()["kv_transfer_params"]["last_hidden_state"] for r in responses]
    assert sorted(map(tuple, vectors)) == sorted(tuple(vector_for(k)) for k in keys)


async def test_other_kv_transfer_params_are_kept_in_the_forwarded_request(
    ring_dir: str, writer: RingWriter
) -> None:
    vllm = FakeVLLM(publishing_handler(writer))
    body = flagged()
    body["kv_transfer_params"]["do_remote_prefill"] = False
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=body)
    assert response.status_code == 200
    (forwarded,) = vllm.requests
    assert orjson.loads(forwarded.content)["kv_transfer_params"] == {"do_remote_prefill": False}
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_state"] == vector_for(forwarded_key(forwarded))


@pytest.mark.parametrize(
    ("kv", "expected_kv"),
    [
        ({"return_last_hidden_state": False}, None),
        ({"return_last_hidden_state": False, "other": 1}, {"other": 1}),
    ],
)
async def test_the_flag_false_is_stripped_and_the_request_is_ordinary(
    kv: dict[str, Any], expected_kv: dict[str, Any] | None
) -> None:
    upstream_body = orjson.dumps(completion())

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=upstream_body)

    vllm = FakeVLLM(handle)
    ring = FakeRing(present=False)
    async with proxy_client(settings_for("/unused"), vllm, ring) as proxy:
        response = await proxy.client.post(
            CHAT, json={"messages": MESSAGES, "kv_transfer_params": kv, "vllm_xargs": {"a": "b"}}
        )
        assert proxy.metrics.requests == {"ordinary": 1, "flagged": 0, "embeddings": 0}
    assert (response.status_code, response.content) == (200, upstream_body)
    sent = orjson.loads(vllm.requests[0].content)
    assert sent.get("kv_transfer_params") == expected_kv
    assert sent["vllm_xargs"] == {"a": "b"}
    assert ring.lookups == 0


async def test_the_ring_passed_to_create_app_is_what_the_proxy_consults() -> None:
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        return httpx.Response(200, json=completion(kv={"x": 1}))

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    kv = response.json()["kv_transfer_params"]
    assert kv["x"] == 1 and len(kv["last_hidden_state"]) == 8
    assert ring.lookups == 1


class LateRing(FakeRing):
    """Holds a record back until it has been looked up ``misses`` times (the worker publishes
    a little after vLLM answered)."""

    def __init__(self, misses: int) -> None:
        super().__init__()
        self.misses = misses
        self.held: dict[bytes, Found] = {}

    def publish(self, found: Found) -> None:
        self.held[found.key] = found

    def lookup(self, key: bytes) -> Found | None:
        found = super().lookup(key)
        if self.lookups > self.misses and key in self.held:
            self.records[key] = self.held.pop(key)
        return found


async def test_a_vector_published_after_the_reply_is_awaited() -> None:
    ring = LateRing(misses=3)
    vllm = FakeVLLM(publishing_handler(ring))
    async with proxy_client(settings_for("/unused", vector_timeout=3600), vllm, ring) as proxy:
        with anyio.fail_after(60):
            response = await proxy.client.post(CHAT, json=flagged())
        assert proxy.metrics.vector_wait.count == 1
    assert response.status_code == 200
    key = forwarded_key(vllm.requests[0])
    assert response.json()["kv_transfer_params"]["last_hidden_state"] == vector_for(key)
    assert ring.lookups == 5  # three misses, the lookup that saw it arrive, the hit


# ---------------------------------------------------------------------------------------------
# never a 200 without the vector
# ---------------------------------------------------------------------------------------------


async def test_a_vector_never_published_is_504(ring_dir: str, writer: RingWriter) -> None:
    vllm = FakeVLLM(publishing_handler(None))  # vLLM answers, nobody publishes
    async with proxy_client(settings_for(ring_dir, vector_timeout=0.05), vllm) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
        assert proxy.metrics.vector_misses["not_published"] == 1
        assert proxy.metrics.vector_wait.count == 0
    assert response.status_code == 504
    error = error_of(response)
    assert error["type"] == "gateway_timeout"
    assert "within 0.05 s" in error["message"]
    assert "not published by the vLLM worker hook" in error["message"]


async def test_a_record_for_another_key_is_never_returned() -> None:
    ring = FakeRing(wrong_key=True)
    vllm = FakeVLLM(publishing_handler(None))
    async with proxy_client(settings_for("/unused", vector_timeout=0.05), vllm, ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 504
    assert ring.lookups >= 2  # the first look, then at least one poll


async def test_a_vector_overwritten_before_the_reply_is_a_504_at_once(
    ring_dir: str, writer: RingWriter
) -> None:
    """The ring reused the slot (more flagged prefills than slots meanwhile): never a wrong
    vector, no wait for the (hour-long) vector timeout, and a message that says what to do."""
    publish_ours = publishing_handler(writer)

    async def handle(request: httpx.Request) -> httpx.Response:
        response = await publish_ours(request)
        for i in range(writer.slot_count):  # other requests' prefills fill every slot
            publish_for(writer, _flagged_request_for(bytes([i + 1]) * 16))
        return response

    settings = settings_for(ring_dir, vector_timeout=3600)
    async with proxy_client(settings, FakeVLLM(handle)) as proxy:
        with anyio.fail_after(60):
            response = await proxy.client.post(CHAT, json=flagged())
        assert proxy.metrics.vector_misses["overwritten"] == 1
    assert response.status_code == 504
    message = error_of(response)["message"]
    assert "overwritten" in message and "HIDDEN_STATE_PROXY_RING_SLOTS" in message
    assert f"({writer.slot_count} slots)" in message


def _flagged_request_for(key: bytes) -> httpx.Request:
    body = {"vllm_xargs": {REQUEST_KEY_ENTRY: key.hex()}}
    return httpx.Request("POST", "http://vllm.test/v1/chat/completions", json=body)


@pytest.mark.parametrize("status", [400, 404, 500])
async def test_vllms_errors_pass_through_unchanged_without_a_lookup(status: int) -> None:
    upstream_body = b'{"error":{"message":"bad model","type":"BadRequestError","code":400}}'

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status,
            headers={"content-type": "application/json; charset=utf-8", "x-vllm": "1"},
            content=upstream_body,
        )

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert (response.status_code, response.content) == (status, upstream_body)
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert response.headers["x-vllm"] == "1"
    assert ring.lookups == 0


@pytest.mark.parametrize("reply", [b"data: {}\n\n", b"[1, 2]", b'"text"', b""])
async def test_a_200_that_is_not_a_json_object_is_502(reply: bytes) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=reply)

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 502
    assert error_of(response)["type"] == "bad_gateway"
    assert ring.lookups == 0


async def test_a_200_breaking_mid_body_is_502_not_200() -> None:
    async def produce() -> AsyncIterator[bytes]:
        yield b'{"id": "x", "choices": ['
        raise httpx.ReadError("connection reset")

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=produce())

    ring = FakeRing()
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
        assert proxy.metrics.upstream_errors == 1
    assert response.status_code == 502
    assert "The exchange with vLLM failed" in error_of(response)["message"]


async def test_a_reply_too_deep_to_re_encode_is_502() -> None:
    """orjson reads it but cannot write it back with the vector joined in."""
    ring = FakeRing()
    reply = b'{"choices": [], "x": ' + b"[" * 300 + b"]" * 300 + b"}"

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=reply)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 502
    assert "re-encoded" in error_of(response)["message"]


# ---------------------------------------------------------------------------------------------
# bodies only some parsers read
# ---------------------------------------------------------------------------------------------


async def test_a_utf16_flagged_body_gets_its_vector(ring_dir: str, writer: RingWriter) -> None:
    """vLLM's parser accepts UTF-16 JSON, so a byte search for the flag alone would miss it."""
    vllm = FakeVLLM(publishing_handler(writer))
    body = orjson.dumps(flagged()).decode().encode("utf-16")
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, content=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_state"] == vector_for(forwarded_key(forwarded))


async def test_a_body_only_pythons_json_accepts_works_flagged(
    ring_dir: str, writer: RingWriter
) -> None:
    """A lone surrogate escape: orjson refuses it, vLLM (Python's json) accepts it."""
    vllm = FakeVLLM(publishing_handler(writer))
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}],'
        b' "kv_transfer_params": {"return_last_hidden_state": true}}'
    )
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(CHAT, content=body)
    assert response.status_code == 200, response.text
    (forwarded,) = vllm.requests
    assert b"\\ud800" in forwarded.content
    assert "last_hidden_state" in response.json()["kv_transfer_params"]


# ---------------------------------------------------------------------------------------------
# a long generation: the record is captured while vLLM still writes the answer
# ---------------------------------------------------------------------------------------------


class WatchedRing(FakeRing):
    """Sets ``looked_up`` on the first lookup that finds a record."""

    def __init__(self) -> None:
        super().__init__()
        self.looked_up = anyio.Event()

    def lookup(self, key: bytes) -> Found | None:
        found = super().lookup(key)
        if found is not None:
            self.looked_up.set()
        return found


async def test_a_record_captured_early_survives_its_slot_being_reused() -> None:
    """vLLM publishes at prefill and streams the JSON body slowly; other prefills then reuse
    the slot. The proxy took the record while the body was still coming, so the answer has it."""
    ring = WatchedRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        key = publish_for(ring, request)
        content = orjson.dumps(completion())

        async def generate() -> AsyncIterator[bytes]:
            yield content[:10]
            await ring.looked_up.wait()  # the early capture found it ...
            del ring.records[key]  # ... and then the ring reused its slot
            ring.overwritten = True
            yield content[10:]

        return httpx.Response(200, headers={"content-type": "application/json"}, content=generate())

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/unused", vector_timeout=3600), vllm, ring) as proxy:
        with anyio.fail_after(60):
            response = await proxy.client.post(CHAT, json=flagged())
    assert response.status_code == 200, response.text
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_state"] == vector_for(forwarded_key(vllm.requests[0]))


# ---------------------------------------------------------------------------------------------
# the building blocks, called directly
# ---------------------------------------------------------------------------------------------


def wanted(layers: tuple[int, ...] | None = None, pooling: str = "last") -> WantedVectors:
    return resolve_layers(VectorRequest(layers=layers, pooling=pooling), [ring_shape(LAYERED)])


def test_the_keyed_body_merges_the_key_into_vllm_xargs() -> None:
    document = {"messages": [], "vllm_xargs": {"a": 1}}
    sent = orjson.loads(keyed_body(document, WIRE, wanted()))
    assert sent == {"messages": [], "vllm_xargs": {"a": 1, REQUEST_KEY_ENTRY: WIRE}}
    assert document == {"messages": [], "vllm_xargs": {"a": 1}}  # the input is not changed
    assert "cache_salt" not in sent


def test_the_keyed_body_asks_for_other_layers_ascending_and_once() -> None:
    sent = orjson.loads(keyed_body({"messages": []}, WIRE, wanted((4, 0, -1, 2))))
    assert sent["vllm_xargs"] == {REQUEST_KEY_ENTRY: WIRE, LAYERS_ENTRY: [0, 2, 4]}
    only_final = orjson.loads(keyed_body({}, WIRE, wanted((-1, 4))))
    assert LAYERS_ENTRY not in only_final["vllm_xargs"]  # the default needs no entry


def test_mean_pooling_asks_for_it_and_bypasses_the_prefix_cache() -> None:
    document = {"messages": [], "cache_salt": "client's"}
    first = orjson.loads(keyed_body(document, WIRE, wanted(pooling="mean")))
    second = orjson.loads(keyed_body(document, WIRE, wanted(pooling="mean")))
    assert first["vllm_xargs"] == {REQUEST_KEY_ENTRY: WIRE, POOLING_ENTRY: "mean"}
    salts = {first["cache_salt"], second["cache_salt"], "client's"}
    assert len(salts) == 3  # fresh each time: no request reads another's cached prefix
    assert all(len(salt) == 32 for salt in salts - {"client's"})
    assert document["cache_salt"] == "client's"


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_non_finite_number_in_a_flagged_body_reaches_vllm_as_written(constant: bytes) -> None:
    """vLLM's parser accepts them; orjson alone would write null."""
    raw = b'{"temperature": ' + constant + b", " + orjson.dumps(flagged())[1:]
    decision = inspect_body(raw)
    assert isinstance(decision, Flagged)
    assert b'"temperature": ' + constant in keyed_body(decision.document, WIRE, wanted())


def test_a_json_reply_is_read_as_an_object_or_none() -> None:
    assert json_object(b'{"id": "x"}') == {"id": "x"}
    assert json_object(b"[1]") is None
    assert json_object(b"data: {}") is None


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("text/event-stream", True),
        ("text/event-stream; charset=utf-8", True),
        ("application/json", False),
        (None, False),
    ],
)
def test_is_event_stream(content_type: str | None, expected: bool) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    assert is_event_stream(httpx.Response(200, headers=headers)) is expected


async def test_a_keyed_request_carries_its_key_and_the_marks_at_sending() -> None:
    ring = FakeRing()
    app = create_app(
        settings_for("/unused"), FakeVLLM(publishing_handler(ring)).transport, ring=ring
    )
    async with app.router.lifespan_context(app):
        state: ProxyState = app.state.proxy
        wanted = resolve_layers(VectorRequest(), ring.live_shapes())
        first = KeyedRequest.prepare(state, {"messages": []}, wanted)
        second = KeyedRequest.prepare(state, {"messages": []}, wanted)
    assert first.key != second.key and len(first.key) == 16
    sent = orjson.loads(first.body)
    assert request_key_from_wire(sent["vllm_xargs"][REQUEST_KEY_ENTRY]) == first.key
    assert first.wanted is wanted
    assert first.marks == {}


async def test_fetch_keyed_json_answers_with_one_of_two_kinds() -> None:
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        if sent_prompt(request) == "refused":
            return httpx.Response(422, headers={"x-v": "1"}, content=b"no")
        if sent_prompt(request) == "lost":
            return httpx.Response(200, json=completion())
        publish_for(ring, request)
        return httpx.Response(200, json=completion())

    settings = settings_for("/unused", vector_timeout=0.01)
    app = create_app(settings, FakeVLLM(handle).transport, ring=ring)
    scope = AsgiCall.scope("POST", CHAT)
    wanted = resolve_layers(VectorRequest(), ring.live_shapes())
    async with app.router.lifespan_context(app):
        state: ProxyState = app.state.proxy
        budget = ReplyBudget(settings.max_answer_bytes)
        joinable = await fetch_keyed_json(state, scope, {"prompt": "ok"}, wanted, budget)
        refused = await fetch_keyed_json(state, scope, {"prompt": "refused"}, wanted, budget)
        with pytest.raises(ProxyError) as caught:
            await fetch_keyed_json(state, scope, {"prompt": "lost"}, wanted, budget)
    assert isinstance(joinable, JoinableReply)
    assert joinable.completion == completion()
    assert joinable.record == record_for(joinable.record.key, (FINAL,))
    assert isinstance(refused, UnchangedReply)
    assert (refused.status, refused.content) == (422, b"no")
    assert (b"x-v", b"1") in refused.headers
    assert caught.value.status == 504


def sent_prompt(request: httpx.Request) -> object:
    return orjson.loads(request.content).get("prompt")


async def test_the_app_without_its_lifespan_refuses_to_run() -> None:
    app = create_app(settings_for("/unused"), FakeVLLM(publishing_handler(None)).transport)
    state: ProxyState = app.state.proxy
    with pytest.raises(RuntimeError, match="lifespan"):
        _ = state.rings
    async with running(app):
        assert state.rings is not None
    with pytest.raises(RuntimeError, match="lifespan"):
        _ = state.transport


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_a_json_reply_over_the_reply_limit_is_502_naming_it(path: str) -> None:
    ring = FakeRing()
    limit = 64 * 1024

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        prompt = sent_prompt(request)
        size = limit if prompt in (None, "big") else 100  # chat sends no prompt
        return httpx.Response(200, json=completion(content="x" * size))

    settings = settings_for("/unused", max_answer_bytes=limit)
    app = create_app(settings, FakeVLLM(handle).transport, ring=ring)
    flag = {"return_last_hidden_state": True}
    body: dict[str, object] = {"model": "m", "kv_transfer_params": flag}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "big"
    async with running(app) as client:
        too_big = await client.post(path, json=body)
        if path != CHAT:  # a list fanned out (pooling "mean") shares one budget: two answers
            # that fit alone do not together (a list sent as one request has one reply)
            mean = {**flag, "last_hidden_state_pooling": "mean"}
            fanned = {**body, KV: mean}
            fits = await client.post(path, json={**fanned, "prompt": ["small"]})
            shared = await client.post(path, json={**fanned, "prompt": ["small"] * 700})
    assert too_big.status_code == 502
    message = too_big.json()["error"]["message"]
    assert f"({limit} bytes, --max-answer-size)" in message
    if path != CHAT:
        assert fits.status_code == 200
        assert shared.status_code == 502 and "--max-answer-size" in shared.text
