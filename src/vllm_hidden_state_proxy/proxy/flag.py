"""Flag detection, validation and request/response rewriting (pure functions, no I/O).

A body is only JSON-parsed when its raw bytes could spell one of the two names the proxy
cares about: the flag name, the reserved ``vllm_xargs`` key, or any JSON ``\\u`` escape (which
could spell either name in a way a plain substring search would miss), or when it is not UTF-8
at all (UTF-16/32 JSON, which vLLM's parser accepts and a byte search cannot read).

Parsing uses orjson, with Python's ``json`` (what vLLM itself uses) as the fallback for what
orjson refuses but vLLM accepts: UTF-16/32, lone surrogate escapes, NaN, huge numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_state_proxy.protocol import XARGS_KEY
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request

FLAG = "return_last_hidden_state"
FORMAT = "last_hidden_state_format"
INFO = "last_hidden_state_info"
KV = "kv_transfer_params"
XARGS = "vllm_xargs"
#: The client-facing keys the proxy owns inside ``kv_transfer_params`` (stripped before vLLM).
OWN_KEYS = (FLAG, FORMAT, INFO)
FORMATS = ("float", "base64")

#: Deepest nesting of a body the proxy re-encodes. Beyond orjson's 254 levels ``json.dumps``
#: takes over, which recurses on the Python stack and fails near 1000 levels (orjson reads up to
#: 1024, so such a body would otherwise parse and then crash the proxy).
MAX_DEPTH = 512

# Every own key contains "last_hidden_state", so one marker covers them all.
_MARKERS = (b"last_hidden_state", XARGS_KEY.encode("ascii"), b"\\u")


@dataclass(frozen=True)
class VectorOptions:
    """How the client wants its vector: ``format`` ("float" | "base64"), ``info`` fields."""

    format: str = "float"
    info: bool = False


@dataclass(frozen=True)
class Forward:
    """Send this body upstream as an ordinary request (``body`` may be the original bytes)."""

    body: bytes


@dataclass(frozen=True)
class Flagged:
    """A valid flagged request; ``document`` already has the proxy's own keys stripped."""

    document: dict[str, Any]
    options: VectorOptions = VectorOptions()


Decision = Forward | Flagged


def _maybe_not_utf8(body: bytes) -> bool:
    """UTF-16/32 JSON (RFC 8259 detection: NUL bytes up front, or a UTF-16/32 byte order mark)."""
    return b"\x00" in body[:4] or body[:2] in (b"\xff\xfe", b"\xfe\xff")


def needs_inspection(body: bytes) -> bool:
    """Cheap pre-filter: could this body mention the flag or the reserved key?"""
    return any(marker in body for marker in _MARKERS) or _maybe_not_utf8(body)


def _load(body: bytes) -> Any:
    """Parse like vLLM would; raises ``ValueError`` if neither parser accepts the body."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # invalid JSON, invalid UTF-8, nesting too deep...
        first_error = exc
    try:
        return json.loads(body)  # ...or only what orjson refuses: UTF-16/32, lone surrogates
    except (ValueError, RecursionError):
        raise ValueError(str(first_error)) from None


def _dumps(document: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document)
    except (orjson.JSONEncodeError, TypeError):  # lone surrogates, NaN: what json.loads accepts
        pass  # ...and nesting deeper than orjson writes (254 levels; it reads 1024)
    try:
        return json.dumps(document).encode("ascii")
    except RecursionError:  # inspect_body refuses such bodies first; this is the backstop
        raise _too_deep() from None


def _too_deep() -> ProxyError:
    return bad_request(f"Request body is nested more than {MAX_DEPTH} levels deep.")


def _check_depth(body: bytes, document: Any) -> None:
    """Refuse (400) a document nested deeper than ``MAX_DEPTH`` before it is re-encoded."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return  # every level opens a bracket: cannot be that deep (almost every body)
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        document = _load(body)
    except ValueError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise bad_request("Request body must be a JSON object.")
    return document


def _check_xargs(document: dict[str, Any]) -> None:
    xargs = document.get(XARGS)
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        raise bad_request(f"'{XARGS}' must be a JSON object.", XARGS)
    if XARGS_KEY in xargs:
        raise _reserved_key_error()


def _reserved_key_error() -> ProxyError:
    return bad_request(
        f"'{XARGS}.{XARGS_KEY}' is reserved for the hidden-state proxy; remove it.", XARGS
    )


def _check_flagged_options(document: dict[str, Any]) -> None:
    """The single place for request options that cannot be combined with the flag."""
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    if document.get("use_beam_search") is True:  # vLLM's beam search drops vllm_xargs
        raise bad_request(
            f"'use_beam_search': true is not supported together with {KV}.{FLAG}.",
            "use_beam_search",
        )


def _options(kv: dict[str, Any]) -> tuple[bool, VectorOptions]:
    """The flag and the vector options, type-checked (each error names its field)."""
    flag = kv.get(FLAG, False)
    if not isinstance(flag, bool):
        raise bad_request(f"'{KV}.{FLAG}' must be a boolean.", f"{KV}.{FLAG}")
    fmt = kv.get(FORMAT, "float")
    if not isinstance(fmt, str):
        raise bad_request(
            f"'{KV}.{FORMAT}' must be a string: one of {', '.join(FORMATS)}.", f"{KV}.{FORMAT}"
        )
    if fmt not in FORMATS:
        raise bad_request(
            f"'{KV}.{FORMAT}' must be one of {', '.join(FORMATS)}, not {fmt!r}.",
            f"{KV}.{FORMAT}",
        )
    info = kv.get(INFO, False)
    if not isinstance(info, bool):
        raise bad_request(f"'{KV}.{INFO}' must be a boolean.", f"{KV}.{INFO}")
    return flag, VectorOptions(format=fmt, info=info)


def inspect_body(body: bytes) -> Decision:
    """Decide what to do with a ``POST /v1/chat/completions`` or ``/v1/completions`` body.

    Raises ``ProxyError`` (400) for bodies the proxy refuses.
    """
    if not needs_inspection(body):
        return Forward(body)
    document = parse_object(body)
    _check_xargs(document)
    kv = document.get(KV)
    if kv is None:
        return Forward(body)
    if not isinstance(kv, dict):
        raise bad_request(f"'{KV}' must be a JSON object.", KV)
    if not any(key in kv for key in OWN_KEYS):
        return Forward(body)
    flag, options = _options(kv)
    _check_depth(body, document)  # from here on the document is re-encoded
    stripped = _without_own_keys(document, kv)
    if not flag:
        return Forward(_dumps(stripped))
    _check_flagged_options(stripped)
    return Flagged(stripped, options)


def check_reserved_key(body: bytes) -> ProxyError | None:
    """For other endpoints: refuse a client-set reserved key, and the flag (a flagged request
    must never get a 200 without its vector); otherwise stay out of the way. Bodies that are not
    JSON objects are left for vLLM.
    """
    if not needs_inspection(body):
        return None
    try:
        document = _load(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    xargs = document.get(XARGS)
    if isinstance(xargs, dict) and XARGS_KEY in xargs:
        return _reserved_key_error()
    kv = document.get(KV)
    if isinstance(kv, dict) and kv.get(FLAG, False) is not False:
        return bad_request(
            f"'{KV}.{FLAG}' is supported on POST /v1/chat/completions and POST /v1/completions "
            "only (and /v1/embeddings returns vectors by design).",
            f"{KV}.{FLAG}",
        )
    return None


def _without_own_keys(document: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy without the proxy's keys; ``kv_transfer_params`` dropped if left empty."""
    result = dict(document)
    rest = {k: v for k, v in kv.items() if k not in OWN_KEYS}
    if rest:
        result[KV] = rest
    else:
        del result[KV]
    return result


def flagged_request_body(document: dict[str, Any], wire_key: str) -> bytes:
    """The body sent to vLLM for a flagged request: the key injected into ``vllm_xargs``."""
    xargs = document.get(XARGS)
    merged = dict(xargs) if isinstance(xargs, dict) else {}
    merged[XARGS_KEY] = wire_key
    return _dumps({**document, XARGS: merged})


def parse_completion(body: bytes) -> dict[str, Any] | None:
    """vLLM's 200 JSON response as a dict, or ``None`` if it is not a JSON object."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return document if isinstance(document, dict) else None


def with_kv_fields(document: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``document`` with ``fields`` merged into its ``kv_transfer_params`` (others kept)."""
    kv = document.get(KV)
    merged = dict(kv) if isinstance(kv, dict) else {}
    merged.update(fields)
    return {**document, KV: merged}
