"""Hostile input (issue #7): inspection, planning, the stream rewrite and the app, fuzzed with
hypothesis.

Nothing crashes, nothing hangs: a validator returns a decision or raises ``ProxyError`` 400; a
flagged stream from a misbehaving upstream is answered 200 (every byte upstream's, except the one
choice event that carries the vector) or with an OpenAI-shaped error. The regressions these found
are plain tests in the modules' own files (test_inspection.py: nesting;
streams/test_prompt_vectors.py and test_keyed_exchange.py: replies too deep to re-encode;
endpoints/test_completions.py: replies that cannot be merged).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.proxy.fakes import (
    LAYERED,
    FakeRing,
    FakeVLLM,
    completion,
    error_of,
    forwarded_key,
    publish_for,
    ring_shape,
    running,
    settings_for,
    vector_for,
)
from vllm_hidden_state_proxy.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_TEMPLATE,
    FLAG,
    FORMAT,
    FORMATS,
    INFO,
    KV,
    LAYERS,
    LIST_BASE_ENTRY,
    LIST_CHECKSUMS_ENTRY,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    OWN_FIELDS,
    POOLING,
    REQUEST_KEY_ENTRY,
    XARGS,
    XARGS_PREFIX,
    request_key_from_wire,
)
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.endpoints.completions import prompt_list
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    EmbeddingsDefaults,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import (
    Flagged,
    Ordinary,
    check_other_endpoint,
    inspect_body,
    needs_inspection,
)
from vllm_hidden_state_proxy.proxy.keyed_request import keyed_body
from vllm_hidden_state_proxy.proxy.planned_fields import CHAT_FIELDS
from vllm_hidden_state_proxy.proxy.streams.prompt_vectors import (
    ChoiceEvent,
    FirstChoiceScanner,
    StreamEnded,
    ended_before_a_choice,
    replace_event,
)
from vllm_hidden_state_proxy.proxy.vectors.fields import with_kv_fields
from vllm_hidden_state_proxy.proxy.vectors.plan import resolve_layers
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
WIRE_KEY = "0123456789abcdef0123456789abcdef"

#: Pure functions: many examples, each a few microseconds.
FAST = settings(max_examples=400, deadline=None)
#: Whole app per example (lifespan, client): fewer.
APP = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),  # orjson's range (see below)
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
#: What a client might put where the proxy expects a bool / a format name / an object.
any_value = st.one_of(
    st.just(True),
    st.just(False),
    st.sampled_from([*FORMATS, "FLOAT", "", "float16", "base64 ", "last", "mean", "Mean"]),
    st.lists(st.integers(-6, 6), max_size=3),
    json_values,
)
kv_values = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            FLAG: any_value,
            FORMAT: any_value,
            INFO: any_value,
            LAYERS: any_value,
            POOLING: any_value,
            "do_remote_prefill": any_value,
            "last_hidden_state": any_value,
        },
    ),
    json_values,
)
xargs_values = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            REQUEST_KEY_ENTRY: json_values,
            XARGS_PREFIX + "layers": json_values,
            XARGS_PREFIX: json_values,
            "hidden_state_proxy": json_values,
            "other": json_values,
        },
    ),
    json_values,
)
token_ids = st.lists(st.integers(min_value=-5, max_value=1 << 20), max_size=4)
prompts = st.one_of(
    st.text(max_size=8),
    token_ids,
    st.lists(st.text(max_size=4), max_size=4),
    st.lists(token_ids, max_size=4),
    st.lists(st.one_of(st.text(max_size=4), token_ids, json_values), max_size=4),
    json_values,
)
random_documents = st.fixed_dictionaries(
    {},
    optional={
        KV: kv_values,
        XARGS: xargs_values,
        "stream": any_value,
        "n": any_value,
        "prompt": prompts,
        "prompt_embeds": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4)), json_values),
        "use_beam_search": any_value,
        "messages": json_values,
        "model": json_values,
    },
)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` three times in four, anything the rest of the time."""
    return st.one_of(valid, valid, valid, any_value)


#: Close to a valid flagged request, so that the deeper checks are reached too.
near_flagged_documents = st.fixed_dictionaries(
    {
        KV: st.fixed_dictionaries(
            {FLAG: mostly(st.just(True))},
            optional={
                FORMAT: st.sampled_from(FORMATS),
                INFO: st.booleans(),
                LAYERS: mostly(st.lists(st.sampled_from([0, 2, 4, -1, -3, -5]), min_size=1)),
                POOLING: mostly(st.sampled_from(["last", "mean"])),
                "other": json_values,
            },
        )
    },
    optional={
        XARGS: st.dictionaries(st.text(max_size=5), json_values, max_size=2),
        "stream": st.booleans(),
        "n": any_value,
        "prompt": prompts,
        "prompt_embeds": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4)), json_values),
        "use_beam_search": st.booleans(),
        "messages": json_values,
    },
)
documents = st.one_of(random_documents, near_flagged_documents)


def _escape_names(text: str) -> str:
    """Spell the names the proxy looks for with JSON escapes (a byte search cannot see them)."""
    for name in (FLAG, KV, XARGS, REQUEST_KEY_ENTRY, LAYERS, POOLING):
        text = text.replace(f'"{name}"', '"' + "".join(f"\\u{ord(c):04x}" for c in name) + '"')
    return text


ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "orjson": orjson.dumps,
    "ascii": lambda doc: json.dumps(doc).encode("ascii"),
    "pretty": lambda doc: json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8"),
    "utf-16": lambda doc: json.dumps(doc).encode("utf-16"),
    "utf-32-be": lambda doc: json.dumps(doc).encode("utf-32-be"),
    "utf-8-bom": lambda doc: b"\xef\xbb\xbf" + orjson.dumps(doc),
    "escaped-names": lambda doc: _escape_names(json.dumps(doc)).encode("ascii"),
}

#: Token soup: mostly-JSON fragments around the names the proxy cares about.
_FRAGMENTS = [
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b" ",
    b"true",
    b"false",
    b"null",
    b"1",
    b"1e400",
    b"NaN",
    b"-Infinity",
    b"18446744073709551616",
    b'"float"',
    b'"base64"',
    b'"\\ud800"',
    b'"\\u0000"',
    b'"\xff"',
    b"\x00",
    f'"{KV}"'.encode(),
    f'"{FLAG}"'.encode(),
    f'"{FORMAT}"'.encode(),
    f'"{INFO}"'.encode(),
    f'"{LAYERS}"'.encode(),
    f'"{POOLING}"'.encode(),
    b'"mean"',
    b"-1",
    f'"{XARGS}"'.encode(),
    f'"{REQUEST_KEY_ENTRY}"'.encode(),
    b'"return_last_hidden_stat\\u0065"',
    b'"stream"',
    b'"use_beam_search"',
    b'"prompt"',
]
token_soup = st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map(b"".join)
FLAGGED_PREFIX = b'{"kv_transfer_params": {"return_last_hidden_state": true}, "x": '


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


def assert_openai_error(error: ProxyError, status: int) -> None:
    assert error.status == status
    body = orjson.loads(error.body())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] is None or isinstance(body["error"]["param"], str)


def vllm_view(body: bytes) -> Any:
    """The body as vLLM's parser (Python's json) reads it; ``None`` if it cannot."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


#: The reserved ``vllm_xargs`` entries a forwarded request may carry besides its key: what to
#: capture, and a prompt list's marker when it is sent as one request.
CAPTURE_ENTRIES = (
    XARGS_PREFIX + "layers",
    XARGS_PREFIX + "pooling",
    LIST_BASE_ENTRY,
    LIST_SIZE_ENTRY,
    LIST_TOKENS_ENTRY,
    LIST_CHECKSUMS_ENTRY,
)


def is_reserved(name: object) -> bool:
    return isinstance(name, str) and name.startswith(XARGS_PREFIX)


def assert_no_proxy_keys(document: Any) -> None:
    """What vLLM receives never carries the proxy's own fields nor a client-set reserved
    entry."""
    if not isinstance(document, dict):
        return
    kv = document.get(KV)
    if isinstance(kv, dict):
        assert not any(name in kv for name in OWN_FIELDS), kv
    xargs = document.get(XARGS)
    if isinstance(xargs, dict):
        assert not any(is_reserved(name) for name in xargs), xargs


def injected_key(request: httpx.Request) -> bytes | None:
    """The key the proxy put into a forwarded request, if any."""
    sent = vllm_view(request.content)
    if isinstance(sent, dict) and isinstance(sent.get(XARGS), dict):
        return request_key_from_wire(sent[XARGS].get(REQUEST_KEY_ENTRY))
    return None


def resolved(decision: Flagged) -> WantedVectors | ProxyError:
    """The decision's layers against a server capturing ``LAYERED``, or the 400 it gets."""
    try:
        return resolve_layers(decision.vectors, [ring_shape(LAYERED)])
    except ProxyError as error:
        assert_openai_error(error, 400)
        assert error.param == f"{KV}.{LAYERS}"
        return error


def check_inspect(body: bytes) -> Ordinary | Flagged | ProxyError:
    """``inspect_body`` returns a decision or raises ProxyError 400 (nothing else), and what
    would be sent to vLLM is clean."""
    try:
        decision = inspect_body(body)
    except ProxyError as error:
        assert_openai_error(error, 400)
        return error
    if isinstance(decision, Ordinary):
        assert_no_proxy_keys(vllm_view(decision.body))
        if decision.body is not body:  # rewritten (flag off): still a JSON object for vLLM
            assert isinstance(vllm_view(decision.body), dict)
        return decision
    assert isinstance(decision, Flagged)
    vectors = decision.vectors
    assert vectors.format in FORMATS and vectors.pooling in ("last", "mean")
    assert isinstance(vectors.info, bool)
    assert vectors.layers is None or (
        vectors.layers and all(type(k) is int for k in vectors.layers)
    )
    assert_no_proxy_keys(decision.document)
    stream = decision.document.get("stream")
    assert stream is None or isinstance(stream, bool)
    n = decision.document.get("n")  # as vLLM reads it: "2" and 2.0 are 2
    assert n is None or type(n) is int
    assert decision.document.get("use_beam_search") is not True
    wanted = resolved(decision)
    if isinstance(wanted, WantedVectors):
        wire = vllm_view(keyed_body(decision.document, WIRE_KEY, wanted))
        assert isinstance(wire, dict)
        assert wire[XARGS][REQUEST_KEY_ENTRY] == WIRE_KEY
        assert not any(name in (wire.get(KV) or {}) for name in OWN_FIELDS)
        assert ("cache_salt" in wire) == (vectors.pooling == "mean") or "cache_salt" in (
            decision.document
        )
    return decision


def _is_layer_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(k, int) and not isinstance(k, bool) for k in value)
    )


def expected_outcome(document: dict[str, Any]) -> str:
    """What the proxy should decide for a (parsed) document: an independent statement of the
    rules in inspection.py."""
    xargs = document.get(XARGS)
    if xargs is not None and (
        not isinstance(xargs, dict) or any(is_reserved(name) for name in xargs)
    ):
        return "400"
    kv = document.get(KV)
    if kv is None:
        return "ordinary"
    if not isinstance(kv, dict):
        return "400"
    if not any(name in kv for name in OWN_FIELDS):
        return "ordinary"
    flag, fmt, info = kv.get(FLAG, False), kv.get(FORMAT, "float"), kv.get(INFO, False)
    if not isinstance(flag, bool) or fmt not in FORMATS or not isinstance(info, bool):
        return "400"
    if LAYERS in kv and kv[LAYERS] is not None and not _is_layer_list(kv[LAYERS]):
        return "400"
    if kv.get(POOLING, "last") not in ("last", "mean"):
        return "400"
    if not flag:
        return "ordinary"
    read = {}
    for name, adapter in CHAT_FIELDS.types.items():  # vLLM's types (test_planned_fields)
        if name in document:
            try:
                read[name] = adapter.validate_python(document[name])
            except ValidationError:
                return "400"
    if read.get("use_beam_search") is True:
        return "400"
    return "flagged"


# ---------------------------------------------------------------------------------------------
# inspection.py: inspect_body, check_other_endpoint
# ---------------------------------------------------------------------------------------------


@FAST
@given(body=st.one_of(st.binary(max_size=300), token_soup))
@example(body=FLAGGED_PREFIX + b"[" * 1000 + b"]" * 1000 + b"}")  # deeper than json.dumps goes
@example(body=FLAGGED_PREFIX.replace(b"true", b"false") + b"[" * 1000 + b"]" * 1000 + b"}")
@example(body=FLAGGED_PREFIX + b"1e400}")
@example(body=FLAGGED_PREFIX + b"NaN}")
@example(body=FLAGGED_PREFIX + b"18446744073709551616}")
def test_inspect_body_on_arbitrary_bytes(body: bytes) -> None:
    event(type(check_inspect(body)).__name__)
    error = asyncio.run(check_other_endpoint(body, None))
    if error is not None:
        assert_openai_error(error, 400)


@FAST
@given(document=documents, encoder=st.sampled_from(sorted(ENCODERS)))
def test_inspect_body_on_generated_documents(document: dict[str, Any], encoder: str) -> None:
    body = ENCODERS[encoder](document)
    outcome = check_inspect(body)
    seen = json.loads(body)  # what vLLM would read
    if not needs_inspection(body):
        assert isinstance(outcome, Ordinary) and outcome.body is body
        assert expected_outcome(seen) in ("ordinary", "400")  # nothing the proxy must act on
        assert_no_proxy_keys(seen)
        return
    kind = {Ordinary: "ordinary", Flagged: "flagged", ProxyError: "400"}[type(outcome)]
    event(kind)
    assert kind == expected_outcome(seen), (seen, outcome)
    if isinstance(outcome, Flagged):
        assert outcome.vectors.format == seen[KV].get(FORMAT, "float")
        assert outcome.vectors.info == seen[KV].get(INFO, False)
        assert outcome.vectors.pooling == seen[KV].get(POOLING, "last")
        layers = seen[KV].get(LAYERS)
        assert outcome.vectors.layers == (None if layers is None else tuple(dict.fromkeys(layers)))
        rest = {k: v for k, v in seen[KV].items() if k not in OWN_FIELDS}
        assert outcome.document.get(KV, {}) == rest


@FAST
@given(
    before=st.binary(max_size=40),
    middle=st.binary(max_size=40),
    after=st.binary(max_size=40),
    marker=st.sampled_from([FLAG, REQUEST_KEY_ENTRY, XARGS_PREFIX, "\\u", FORMAT, LAYERS, POOLING]),
)
def test_inspect_body_with_markers_in_garbage(
    before: bytes, middle: bytes, after: bytes, marker: str
) -> None:
    body = before + marker.encode() + middle + marker.encode() + after
    check_inspect(body)
    error = asyncio.run(check_other_endpoint(body, None))
    if error is not None:
        assert_openai_error(error, 400)


# ---------------------------------------------------------------------------------------------
# endpoints/completions.prompt_list, endpoints/embeddings_plan.plan_embeddings
# ---------------------------------------------------------------------------------------------


prompt_lists = st.one_of(
    st.lists(st.text(max_size=4), min_size=1, max_size=4),
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=4),
)


@FAST
@given(
    document=st.one_of(
        documents,
        st.fixed_dictionaries({"prompt": prompt_lists}, optional={"stream": st.booleans()}),
    )
)
def test_prompt_list_is_400_or_a_valid_list(document: dict[str, Any]) -> None:
    try:
        prompts = prompt_list(document, 2048)
    except ProxyError as error:
        assert_openai_error(error, 400)
        event("400")
        return
    event("single" if prompts is None else "list")
    if prompts is None:
        prompt = document.get("prompt")
        assert prompt is None or isinstance(prompt, (str, list))
        return
    assert prompts == document["prompt"] and len(prompts) >= 1
    assert document.get("stream") is not True
    if isinstance(prompts[0], str):
        assert all(isinstance(p, str) for p in prompts)
    else:
        for ids in prompts:
            assert isinstance(ids, list) and ids
            assert all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


embedding_inputs = st.one_of(
    st.text(max_size=6),
    st.lists(st.text(max_size=6), max_size=5),
    token_ids,
    st.lists(token_ids, max_size=5),
    # (64-bit: the app tests write these documents with orjson, which takes no larger ints)
    st.lists(
        st.one_of(st.text(max_size=3), token_ids, st.integers(-(2**63), 2**63 - 1)), max_size=4
    ),
    json_values,
)
embedding_documents = st.fixed_dictionaries(
    {},
    optional={
        "input": embedding_inputs,
        "messages": json_values,
        "model": any_value,
        "encoding_format": any_value,
        "normalize": any_value,
        "dimensions": st.one_of(st.integers(-3, 10), any_value),
        "instruction": st.one_of(st.just("Q: {text}"), any_value),
        "add_generation_prompt": any_value,
        "continue_final_message": any_value,
        "chat_template_kwargs": any_value,
        "layer": st.one_of(st.integers(-6, 6), any_value),
        "pooling": any_value,
    },
)
near_valid_embedding_documents = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=3),
        "encoding_format": st.sampled_from(FORMATS),
        "normalize": st.booleans(),
        "dimensions": st.integers(1, 8),
        "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=3), json_values),
        "layer": st.sampled_from([0, 2, 4, -1, -3, 1]),
        "pooling": st.sampled_from(["last", "mean"]),
    },
).flatmap(
    lambda document: st.one_of(
        st.builds(lambda i: {**document, "input": i}, embedding_inputs),
        st.builds(lambda m: {**document, "messages": m}, st.lists(json_values, min_size=1)),
    )
)


@FAST
@given(
    document=st.one_of(embedding_documents, near_valid_embedding_documents),
    max_inputs=st.integers(1, 6),
)
def test_plan_embeddings_is_400_or_a_valid_plan(document: dict[str, Any], max_inputs: int) -> None:
    try:
        plan = plan_embeddings(document, EmbeddingsDefaults(DEFAULT_TEMPLATE, max_inputs))
    except ProxyError as error:
        assert_openai_error(error, 400)
        event("400")
        return
    event(f"plan: {plan.field}")
    assert plan.encoding_format in FORMATS
    assert isinstance(plan.normalize, bool)
    assert plan.dimensions is None or (type(plan.dimensions) is int and plan.dimensions > 0)
    assert 1 <= len(plan.calls) <= max_inputs
    assert plan.field in ("input", "messages")
    assert plan.vectors.layers is not None and len(plan.vectors.layers) == 1
    assert plan.vectors.pooling in ("last", "mean")
    try:
        wanted = resolve_layers(plan.vectors, [ring_shape(LAYERED)], param="layer")
    except ProxyError as error:
        assert_openai_error(error, 400)
        assert error.param == "layer"
        return
    for path, body in plan.calls:
        assert path in (CHAT_PATH, COMPLETIONS_PATH)
        assert isinstance(vllm_view(keyed_body(body, WIRE_KEY, wanted)), dict)


# ---------------------------------------------------------------------------------------------
# streams/prompt_vectors.py: scanning is independent of chunking; a rewrite touches one event
# ---------------------------------------------------------------------------------------------


def _chunk_event(choices: Any, **extra: Any) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chunk", "choices": choices, **extra})


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


#: A choice event nested deeper (300) than orjson writes (255), not deeper than it reads (1024).
DEEP_CHOICE = b"data: " + json.dumps({"choices": [_deep(300)]}).encode()

choice_events = st.builds(
    _chunk_event,
    st.lists(
        st.fixed_dictionaries({"index": st.integers(0, 3), "delta": json_values}),
        min_size=1,
        max_size=2,
    ),
)
sse_events = st.one_of(
    choice_events,
    choice_events,
    st.builds(_chunk_event, st.just([])),  # usage chunk
    st.builds(lambda c: _chunk_event(c, kv_transfer_params=5), json_values),
    st.sampled_from(
        [
            b"data: [DONE]",
            b"data:[DONE]",
            b"data:  [DONE] ",
            b": keep-alive",
            b"event: message\nid: 7",
            b"retry: 10",
            b"data",
            b"data:",
            b'data: {"choices": [1]',  # truncated JSON
            b'data: {"choices":\ndata: [{"index": 0}]}',  # JSON across two data lines
            b'data: {"choices": [null], "kv_transfer_params": {"a": 1}}',
            b'data: {"choices": "x"}',
            b'data: {"choices": {"0": 1}}',
            b'data: {"error": {"message": "bad", "code": 400}}',
            b'data: {"choices": [0], "n": 18446744073709551616}',
            b'data: {"choices": [0], "s": "\\ud800"}',
            b'data: {"choices": [0], "x": NaN}',
            DEEP_CHOICE,  # orjson parses it but cannot write it back
            b"data: " + b"[" * 2000 + b"]" * 2000,
        ]
    ),
    st.binary(max_size=30),
    st.text(max_size=20).map(lambda t: b"data: " + t.encode()),
)
separators = st.one_of(
    st.just(b"\n\n"),  # vLLM's
    st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n", b"\r\n", b"\n\r\n", b""]),
)
sse_streams = st.lists(st.tuples(sse_events, separators), max_size=8).map(
    lambda parts: b"".join(event + sep for event, sep in parts)
)


#: A stream with a well-formed choice event somewhere (what vLLM sends, among other things).
streams_with_a_choice = st.builds(
    lambda before, choice, after: before + choice + b"\n\n" + after,
    sse_streams,
    choice_events,
    sse_streams,
)


def pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def scan_incrementally(chunks: list[bytes]) -> ChoiceEvent | StreamEnded | None:
    scanner = FirstChoiceScanner()
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        found = scanner.scan(buffer)
        if found is not None:
            return found
    return None


@FAST
@given(stream=sse_streams, cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_scanner_result_does_not_depend_on_chunking(stream: bytes, cuts: list[int]) -> None:
    whole = FirstChoiceScanner().scan(stream)
    event(type(whole).__name__)
    assert scan_incrementally(pieces(stream, cuts)) == whole
    if len(stream) <= 2000:  # one byte at a time rescans the pending event: quadratic
        one_byte = scan_incrementally([stream[i : i + 1] for i in range(len(stream))])
        assert one_byte == whole


@FAST
@given(
    stream=st.one_of(sse_streams, streams_with_a_choice),
    fields=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
)
def test_replace_event_rewrites_only_the_choice_event(
    stream: bytes, fields: dict[str, Any]
) -> None:
    found = FirstChoiceScanner().scan(stream)
    if not isinstance(found, ChoiceEvent):
        return
    new_chunk = with_kv_fields(found.chunk, fields)
    try:
        out = replace_event(stream, found, new_chunk)
    except ProxyError as error:  # a chunk too deeply nested to re-encode
        assert_openai_error(error, 502)
        return
    assert out.startswith(stream[: found.start])
    assert out.endswith(stream[found.end :])
    middle = out[found.start : len(out) - (len(stream) - found.end)]
    assert middle.startswith(b"data: ") and b"\n" not in middle and b"\r" not in middle
    assert orjson.loads(middle[len(b"data: ") :]) == orjson.loads(orjson.dumps(new_chunk))
    again = FirstChoiceScanner().scan(out)  # still the first choice event, at the same place
    assert isinstance(again, ChoiceEvent) and again.start == found.start


# ---------------------------------------------------------------------------------------------
# The app: flagged streams from a misbehaving upstream
# ---------------------------------------------------------------------------------------------


@asynccontextmanager
async def serving(vllm: FakeVLLM, ring: FakeRing) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy app (lifespan running) in front of ``vllm``, with an in-process client."""
    settings = settings_for("/unused", vector_timeout=0.2)
    async with running(create_app(settings, vllm.transport, ring=ring)) as client:
        yield client


def expected_stream(upstream: bytes, key: bytes) -> tuple[int, bytes | None]:
    """(status, body) the proxy should answer for a flagged stream of ``upstream``'s bytes."""
    scanner = FirstChoiceScanner()
    found = scanner.scan(upstream)
    if not isinstance(found, ChoiceEvent):  # never a 200: vLLM's in-stream error, or a 502
        return ended_before_a_choice(scanner.error)
    fields = {"last_hidden_state": vector_for(key)}
    try:
        return 200, replace_event(upstream, found, with_kv_fields(found.chunk, fields))
    except ProxyError as error:
        return error.status, None


def streaming_upstream(ring: FakeRing, chunks: list[bytes]) -> FakeVLLM:
    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)

        async def produce() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk
                await anyio.sleep(0)

        headers = {"content-type": "text/event-stream; charset=utf-8"}
        return httpx.Response(200, headers=headers, content=produce())

    return FakeVLLM(handle)


FLAGGED_STREAM = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    KV: {FLAG: True},
}


@APP
@given(
    upstream=st.one_of(sse_streams, streams_with_a_choice, st.binary(max_size=400)),
    cuts=st.lists(st.integers(0, 4000), max_size=10),
)
@example(upstream=DEEP_CHOICE + b"\n\n" + b"data: [DONE]\n\n", cuts=[9])
async def test_flagged_stream_from_a_misbehaving_upstream(upstream: bytes, cuts: list[int]) -> None:
    ring = FakeRing()
    vllm = streaming_upstream(ring, pieces(upstream, cuts))
    with anyio.fail_after(10):
        async with serving(vllm, ring) as client:
            response = await client.post(CHAT, json=FLAGGED_STREAM)
    status, body = expected_stream(upstream, forwarded_key(vllm.requests[0]))
    event(f"{status}, {type(FirstChoiceScanner().scan(upstream)).__name__}")
    assert response.status_code == status, response.content[:300]
    if body is not None:
        assert response.content == body
        kind = "text/event-stream" if status == 200 else "application/json"
        assert response.headers["content-type"].startswith(kind)
    else:
        error_of(response)


@APP
@given(
    answer=st.one_of(
        json_values.map(orjson.dumps),
        st.builds(completion, st.dictionaries(st.text(max_size=5), json_values)).map(orjson.dumps),
        st.binary(max_size=200),
    ),
    content_type=st.sampled_from(["application/json", "text/plain", "text/event-stream"]),
)
async def test_flagged_json_from_a_misbehaving_upstream(answer: bytes, content_type: str) -> None:
    """A 200 that is not a JSON object: 502 (or, sent as a stream, relayed as one)."""
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        return httpx.Response(200, headers={"content-type": content_type}, content=answer)

    vllm = FakeVLLM(handle)
    body = {**FLAGGED_STREAM, "stream": False}
    with anyio.fail_after(10):
        async with serving(vllm, ring) as client:
            response = await client.post(CHAT, json=body)
    key = forwarded_key(vllm.requests[0])
    if content_type == "text/event-stream":
        status, expected = expected_stream(answer, key)
        assert (response.status_code, response.content) == (status, expected)
        return
    if not isinstance(orjson_view(answer), dict):
        assert response.status_code == 502
        error_of(response)
        return
    assert response.status_code == 200
    joined = response.json()
    assert joined[KV]["last_hidden_state"] == vector_for(key)


def orjson_view(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


@APP
@given(
    body=st.one_of(
        st.binary(max_size=300),
        token_soup,
        documents.map(orjson.dumps),
        near_valid_embedding_documents.map(orjson.dumps),
    )
)
# Flagged prompt lists, sent as one request (found by the fuzz once the proxy did so).
@example(body=b'{"kv_transfer_params":{"return_last_hidden_state":true},"prompt":[""]}')
@example(body=b'{"kv_transfer_params":{"return_last_hidden_state":true},"prompt":[[1,2,3],[4]]}')
async def test_any_body_gets_a_decision_through_the_app(body: bytes) -> None:
    """Through the app: a 4xx in the OpenAI shape, or forwarded (the fake vLLM answers 200 JSON,
    publishing the vector); never a 5xx, never an exception."""
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        if injected_key(request) is not None:
            publish_for(ring, request)
        answer = completion()
        sent = vllm_view(request.content)
        xargs = sent.get(XARGS) if isinstance(sent, dict) else None
        listed = xargs.get(LIST_SIZE_ENTRY) if isinstance(xargs, dict) else None
        if isinstance(listed, int):  # a prompt list sent as one request: a choice a prompt
            answer["choices"] = [{**answer["choices"][0], "index": i} for i in range(listed)]
        return httpx.Response(200, json=answer)

    vllm = FakeVLLM(handle)
    with anyio.fail_after(10):
        async with serving(vllm, ring) as client:
            for path in (CHAT, "/v1/completions", "/v1/embeddings", "/v1/responses"):
                response = await client.post(path, content=body)
                event(f"{path}: {response.status_code}")
                if response.status_code != 200:
                    assert 400 <= response.status_code < 500, response.content[:300]
                    error_of(response)
    for request in vllm.requests:
        sent = vllm_view(request.content)
        xargs = sent.get(XARGS) if isinstance(sent, dict) else None
        if isinstance(xargs, dict) and REQUEST_KEY_ENTRY in xargs:  # the proxy's own, fresh key
            wire = xargs.pop(REQUEST_KEY_ENTRY)
            assert request_key_from_wire(wire) is not None and wire.encode() not in body
            for name in [name for name in xargs if is_reserved(name)]:  # what to capture
                assert name in CAPTURE_ENTRIES, name
                del xargs[name]
        assert_no_proxy_keys(sent)
