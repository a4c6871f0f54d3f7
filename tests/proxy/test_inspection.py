"""Request inspection (proxy/inspection.py): ordinary or flagged, valid or a 400 naming the field;
what a flagged request asks for. No I/O."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from vllm_hidden_state_proxy.protocol import (
    LAYERS_ENTRY,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    XARGS_PREFIX,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import (
    MAX_DEPTH,
    Flagged,
    Ordinary,
    check_other_endpoint,
    encode_document,
    inspect_body,
    needs_inspection,
    parse_object,
)
from vllm_hidden_state_proxy.request_fields import VectorRequest
from vllm_hidden_state_proxy.ring import MAX_LAYERS

KV = "kv_transfer_params"
WIRE = "ab" * 16


def body(document: dict[str, Any]) -> bytes:
    return orjson.dumps(document)


def flagged(**kv: Any) -> bytes:
    return body({"messages": [], KV: {"return_last_hidden_state": True, **kv}})


def refused(raw: bytes) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        inspect_body(raw)
    assert caught.value.status == 400
    return caught.value


# ---------------------------------------------------------------------------------------------
# the byte pre-filter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"messages": [{"role": "user", "content": "hello"}]}', False),
        (b'{"kv_transfer_params": {"return_last_hidden_state": true}}', True),
        (b'{"kv_transfer_params": {"last_hidden_state_layers": [1]}}', True),
        (b'{"vllm_xargs": {"hidden_state_proxy_anything": 1}}', True),
        (b'{"content": "caf\\u00e9"}', True),  # any escape may spell a name: inspect
        ('{"content": "café"}'.encode(), False),
        ('{"a": 1}'.encode("utf-16"), True),  # not UTF-8: a byte search cannot read it
        ('{"a": 1}'.encode("utf-32-be"), True),
        (b"\xfe\xff\x00{\x00}", True),
    ],
)
def test_needs_inspection(raw: bytes, expected: bool) -> None:
    assert needs_inspection(raw) is expected


# ---------------------------------------------------------------------------------------------
# ordinary bodies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"content": "what is return_last_hidden_state?"}]}',
        b'{"messages": [], "kv_transfer_params": {"x": "return_last_hidden_state"}}',
        b'{"messages": [], "kv_transfer_params": null}',
        b'{"content": "caf\\u00e9", "max_tokens": 1.50e1}',
    ],
)
def test_bodies_without_own_fields_go_as_they_are(raw: bytes) -> None:
    decision = inspect_body(raw)
    assert isinstance(decision, Ordinary) and decision.body is raw


@pytest.mark.parametrize(
    ("kv", "rest"),
    [
        ({"return_last_hidden_state": False}, None),
        (
            {"return_last_hidden_state": False, "do_remote_prefill": True},
            {"do_remote_prefill": True},
        ),
        ({"last_hidden_state_format": "base64"}, None),
        ({"last_hidden_state_layers": [0], "last_hidden_state_pooling": "mean"}, None),
    ],
)
def test_own_fields_without_the_flag_are_stripped(
    kv: dict[str, Any], rest: dict[str, Any] | None
) -> None:
    decision = inspect_body(body({"messages": [], KV: kv, "n": 2}))
    assert isinstance(decision, Ordinary)
    sent = orjson.loads(decision.body)
    assert sent.get(KV) == rest
    assert sent["n"] == 2 and sent["messages"] == []


# ---------------------------------------------------------------------------------------------
# flagged bodies
# ---------------------------------------------------------------------------------------------


def test_a_flagged_document_is_stripped_of_the_proxys_fields() -> None:
    decision = inspect_body(
        body(
            {
                "n": 1,
                "stream": False,
                KV: {"return_last_hidden_state": True, "do_remote_prefill": False},
            }
        )
    )
    assert decision == Flagged({"n": 1, "stream": False, KV: {"do_remote_prefill": False}})
    assert isinstance(decision, Flagged)
    assert decision.vectors == VectorRequest()


def test_what_a_flagged_request_asks_for() -> None:
    decision = inspect_body(
        flagged(
            last_hidden_state_format="base64",
            last_hidden_state_info=True,
            last_hidden_state_layers=[4, -1, 0, 0],
            last_hidden_state_pooling="mean",
        )
    )
    assert isinstance(decision, Flagged)
    # Each label once (the answer's keys), in the order first given.
    assert decision.vectors == VectorRequest("base64", True, (4, -1, 0), "mean")
    assert decision.document == {"messages": []}


def test_a_layer_list_longer_than_any_server_captures_is_refused_before_reading_it() -> None:
    at_most = [0] * MAX_LAYERS
    decision = inspect_body(flagged(last_hidden_state_layers=at_most))
    assert isinstance(decision, Flagged) and decision.vectors.layers == (0,)
    # 200,000 labels (what took the event loop ~0.3 s per prompt) and one that is not even an
    # integer: the count alone refuses them, naming the field and the limit.
    for too_many in ([0] * 200_000, [0] * MAX_LAYERS + ["x"]):
        with pytest.raises(ProxyError) as caught:
            inspect_body(flagged(last_hidden_state_layers=too_many))
        error = caught.value
        assert (error.status, error.param) == (400, f"{KV}.last_hidden_state_layers")
        assert f"at most {MAX_LAYERS}" in error.message


def test_an_escaped_flag_is_still_the_flag() -> None:
    raw = b'{"kv_transfer_params": {"return_last_hidden_stat\\u0065": true}}'
    assert isinstance(inspect_body(raw), Flagged)


@pytest.mark.parametrize(
    "encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-be"], ids=lambda name: name
)
def test_utf16_and_utf32_flagged_bodies_are_recognised(encoding: str) -> None:
    raw = json.dumps({"messages": [], KV: {"return_last_hidden_state": True}}).encode(encoding)
    assert b"return_last_hidden_state" not in raw
    assert inspect_body(raw) == Flagged({"messages": []})


def test_a_body_only_pythons_json_accepts_is_kept_that_way() -> None:
    raw = b'{"x": "\\ud800", ' + flagged()[1:]
    decision = inspect_body(raw)
    assert isinstance(decision, Flagged)
    sent = encode_document(decision.document)
    assert b"\\ud800" in sent  # a lone surrogate survives the rewrite (json.dumps fallback)


# ---------------------------------------------------------------------------------------------
# refusals: each names its field
# ---------------------------------------------------------------------------------------------

REFUSALS = {
    "array-body": (b'[{"kv_transfer_params": {"return_last_hidden_state": true}}]', None),
    "string-body": (b'"return_last_hidden_state"', None),
    "invalid-json": (b'{"kv_transfer_params": {"return_last_hidden_state": true}', None),
    "kv-not-object": (body({KV: ["return_last_hidden_state"]}), KV),
    "flag-int": (body({KV: {"return_last_hidden_state": 1}}), f"{KV}.return_last_hidden_state"),
    "flag-null": (body({KV: {"return_last_hidden_state": None}}), f"{KV}.return_last_hidden_state"),
    "format-unknown": (flagged(last_hidden_state_format="f16"), f"{KV}.last_hidden_state_format"),
    "format-unflagged": (
        body({KV: {"last_hidden_state_format": "b64"}}),
        f"{KV}.last_hidden_state_format",
    ),
    "info-not-bool": (flagged(last_hidden_state_info="yes"), f"{KV}.last_hidden_state_info"),
    "layers-not-list": (flagged(last_hidden_state_layers=4), f"{KV}.last_hidden_state_layers"),
    "layers-empty": (flagged(last_hidden_state_layers=[]), f"{KV}.last_hidden_state_layers"),
    "layers-strings": (flagged(last_hidden_state_layers=["4"]), f"{KV}.last_hidden_state_layers"),
    "layers-float": (flagged(last_hidden_state_layers=[1.0]), f"{KV}.last_hidden_state_layers"),
    "layers-bool": (flagged(last_hidden_state_layers=[True]), f"{KV}.last_hidden_state_layers"),
    "layers-null": (
        body({KV: {"return_last_hidden_state": True, "last_hidden_state_layers": [None]}}),
        f"{KV}.last_hidden_state_layers",
    ),
    "layers-unflagged": (
        body({KV: {"last_hidden_state_layers": "all"}}),
        f"{KV}.last_hidden_state_layers",
    ),
    "pooling-unknown": (
        flagged(last_hidden_state_pooling="max"),
        f"{KV}.last_hidden_state_pooling",
    ),
    "pooling-case": (flagged(last_hidden_state_pooling="Mean"), f"{KV}.last_hidden_state_pooling"),
    "pooling-not-str": (flagged(last_hidden_state_pooling=1), f"{KV}.last_hidden_state_pooling"),
    "stream-not-bool": (body({"stream": 2, KV: {"return_last_hidden_state": True}}), "stream"),
    "beam-search": (
        body({"use_beam_search": True, KV: {"return_last_hidden_state": True}}),
        "use_beam_search",
    ),
    "xargs-not-object": (
        body({"vllm_xargs": [1], KV: {"return_last_hidden_state": True}}),
        "vllm_xargs",
    ),
    "reserved-key": (body({"vllm_xargs": {REQUEST_KEY_ENTRY: WIRE}}), "vllm_xargs"),
    "reserved-layers": (body({"vllm_xargs": {LAYERS_ENTRY: [1]}}), "vllm_xargs"),
    "reserved-pooling": (body({"vllm_xargs": {POOLING_ENTRY: "mean"}}), "vllm_xargs"),
    "reserved-any": (body({"vllm_xargs": {XARGS_PREFIX + "future": 1}}), "vllm_xargs"),
    "reserved-escaped": (b'{"vllm_xargs": {"hidden_state_proxy\\u005fkey": "00"}}', "vllm_xargs"),
    "reserved-flagged": (
        body({"vllm_xargs": {REQUEST_KEY_ENTRY: WIRE}, KV: {"return_last_hidden_state": True}}),
        "vllm_xargs",
    ),
    "reserved-utf16": (
        json.dumps({"vllm_xargs": {REQUEST_KEY_ENTRY: "00"}}).encode("utf-16"),
        "vllm_xargs",
    ),
}


@pytest.mark.parametrize(("raw", "param"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_refusals_name_their_field(raw: bytes, param: str | None) -> None:
    assert refused(raw).param == param


def test_the_messages_say_what_is_wrong() -> None:
    assert "reserved for the hidden-state proxy" in refused(REFUSALS["reserved-any"][0]).message
    assert XARGS_PREFIX + "future" in refused(REFUSALS["reserved-any"][0]).message
    layers = refused(REFUSALS["layers-strings"][0]).message
    assert "non-empty list of layer indices" in layers and "-1 is the final layer" in layers
    assert "last, mean" in refused(REFUSALS["pooling-unknown"][0]).message
    assert "float, base64" in refused(REFUSALS["format-unknown"][0]).message
    assert "not valid JSON" in refused(REFUSALS["invalid-json"][0]).message
    assert "must be a JSON object" in refused(REFUSALS["array-body"][0]).message


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("flag", [b"true", b"false"])
def test_a_body_nested_deeper_than_the_limit_is_400(flag: bytes) -> None:
    """orjson parses 1024 levels; re-encoding beyond 254 falls back to json.dumps, which fails
    near 1000. Such a body is a 400, never a 500."""
    prefix = b'{"kv_transfer_params": {"return_last_hidden_state": ' + flag + b'}, "x": '
    assert "nested" in refused(prefix + nested(MAX_DEPTH) + b"}").message
    assert "nested" in refused(prefix + nested(1000) + b"}").message
    # The limit is on nesting, not on brackets: many shallow ones, or ones in strings, are fine.
    wide = prefix + b"[" + b"[], " * 2000 + b'"' + b"[" * 2000 + b'"]}'
    assert isinstance(inspect_body(wide), (Flagged, Ordinary))
    assert isinstance(inspect_body(prefix + nested(MAX_DEPTH - 1) + b"}"), (Flagged, Ordinary))


def test_a_deep_ordinary_body_is_not_parsed_at_all() -> None:
    raw = b'{"x": ' + nested(100_000) + b"}"
    decision = inspect_body(raw)
    assert isinstance(decision, Ordinary) and decision.body is raw


# ---------------------------------------------------------------------------------------------
# other endpoints: only the reserved entries and the flag itself are refused
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (body({"input": "x", "vllm_xargs": {REQUEST_KEY_ENTRY: WIRE}}), "vllm_xargs"),
        (body({"vllm_xargs": {XARGS_PREFIX + "layers": [0]}}), "vllm_xargs"),
        (body({KV: {"return_last_hidden_state": True}}), f"{KV}.return_last_hidden_state"),
        (body({KV: {"return_last_hidden_state": "yes"}}), f"{KV}.return_last_hidden_state"),
    ],
)
def test_other_endpoints_refuse_reserved_entries_and_the_flag(raw: bytes, param: str) -> None:
    error = asyncio.run(check_other_endpoint(raw, None))
    assert error is not None and (error.status, error.param) == (400, param)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input": "x"}',
        body({KV: {"return_last_hidden_state": False, "last_hidden_state_format": "x"}}),
        b'{"vllm_xargs": {"\\u0068" [}',  # not JSON, and no prefix as it is: left for vLLM
        b'["hidden_state_proxy_key"]',
        body({"vllm_xargs": ["hidden_state_proxy_key"]}),
        body({KV: "return_last_hidden_state"}),
    ],
)
def test_other_endpoints_leave_the_rest_to_vllm(raw: bytes) -> None:
    assert asyncio.run(check_other_endpoint(raw, None)) is None


# ---------------------------------------------------------------------------------------------
# small parsers
# ---------------------------------------------------------------------------------------------


def test_parse_object() -> None:
    assert parse_object(b'{"a": 1}') == {"a": 1}
    with pytest.raises(ProxyError, match="must be a JSON object"):
        parse_object(b"[1]")


def test_encode_document_falls_back_to_pythons_json() -> None:
    assert encode_document({"a": 1}) == b'{"a":1}'
    assert encode_document({"s": "\ud800"}) == b'{"s": "\\ud800"}'
    assert encode_document({"n": 1 << 70}) == b'{"n": 1180591620717411303424}'
