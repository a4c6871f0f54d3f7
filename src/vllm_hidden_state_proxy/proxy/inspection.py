"""Request inspection: is this chat/completions body flagged, and is it valid? (no I/O)

A body is only JSON-parsed when its raw bytes could spell one of the names the proxy cares
about: its own ``kv_transfer_params`` fields, its reserved ``vllm_xargs`` entries, or any JSON
``\\u`` escape (which could spell either in a way a plain substring search would miss), or when
it is not UTF-8 at all (UTF-16/32 JSON, which vLLM's parser accepts and a byte search cannot
read). Everything else is :class:`Ordinary` and goes to vLLM byte for byte.

Parsing uses orjson, with Python's ``json`` (what vLLM itself uses) as the fallback for what
orjson refuses but vLLM accepts: UTF-16/32, lone surrogate escapes, NaN, huge numbers. A body
the proxy re-encodes must mean to vLLM what the client's meant, number for number: orjson reads
an integer beyond 64 bits as a float (``2**70`` would come back as ``1.1805916207174113e+21``)
and refuses ``1e999``, which ``json`` reads as an infinity that orjson writes as ``null``. So a
body with a run of 19 or more digits (a cheap byte search) or a number orjson refuses is read
by ``json``, exactly as vLLM reads it, and a document holding such an integer or a
non-finite float is written by ``json`` (``Infinity``, ``-Infinity``, ``NaN``: vLLM reads them
back as the same floats).

The flagged request's fields the proxy plans with are read as vLLM reads them
(:mod:`.planned_fields`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from vllm_hidden_state_proxy import request_fields
from vllm_hidden_state_proxy.protocol import FLAG, KV, OWN_FIELDS, XARGS, XARGS_PREFIX
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request
from vllm_hidden_state_proxy.proxy.planned_fields import (
    CHAT_FIELDS,
    PlannedFields,
    read_planned_fields,
)
from vllm_hidden_state_proxy.proxy.reserved_entries import (
    could_spell_reserved,
    form_refusal,
    is_form,
    json_refusal,
    reserved_entry_error,
    unreadable_refusal,
)
from vllm_hidden_state_proxy.request_fields import RequestFieldError, VectorRequest

#: Deepest nesting of a body the proxy re-encodes. Beyond orjson's 254 levels ``json.dumps``
#: takes over, which recurses on the Python stack and fails near 1000 levels (orjson reads up to
#: 1024, so such a body would otherwise parse and then crash the proxy).
MAX_DEPTH = 512

# Every own field contains "last_hidden_state", so one marker covers them all.
_MARKERS = (b"last_hidden_state", XARGS_PREFIX.encode("ascii"), b"\\u")


@dataclass(frozen=True)
class Ordinary:
    """Send this body upstream as an ordinary request (``body`` may be the original bytes)."""

    body: bytes


@dataclass(frozen=True)
class Flagged:
    """A valid flagged request; ``document`` already has the proxy's own fields stripped."""

    document: dict[str, Any]
    vectors: VectorRequest = field(default_factory=VectorRequest)


Decision = Ordinary | Flagged


def _maybe_not_utf8(body: bytes) -> bool:
    """UTF-16/32 JSON (RFC 8259 detection: NUL bytes up front, or a UTF-16/32 byte order mark)."""
    return b"\x00" in body[:4] or body[:2] in (b"\xff\xfe", b"\xfe\xff")


def needs_inspection(body: bytes) -> bool:
    """Cheap pre-filter: could this body mention the flag or a reserved entry?"""
    return any(marker in body for marker in _MARKERS) or _maybe_not_utf8(body)


class _NonFinite(float):
    """NaN or an infinity read by Python's parser: orjson refuses to write this subclass (it
    would write ``null``), so :func:`encode_document` falls back to ``json``, which keeps it."""


def _float(literal: str) -> float:
    """A JSON number with a fraction or exponent, as ``json`` reads it (``1e999`` is an
    infinity, kept as :class:`_NonFinite`)."""
    value = float(literal)
    return value if math.isfinite(value) else _NonFinite(value)


#: Every digit as ``0``, so that one substring search finds a run of 19 digits (``re`` tries
#: a character class at every position: 40 times slower).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
#: An integer orjson might read as a float (beyond 64 bits: 2**64 has 20 digits, -2**63-1 19),
#: or a harmless look-alike (a long fraction, digits in a string): then ``json`` reads the body.
_WIDE_DIGITS = b"0" * 19


def _may_be_wide(body: bytes) -> bool:
    return _WIDE_DIGITS in body.translate(_DIGITS_AS_ZERO)


def _load(body: bytes) -> Any:
    """Parse like vLLM would; raises ``ValueError`` if neither parser accepts the body. (A
    float that overflows orjson refuses, so ``json`` reads it.)"""
    first_error: Exception | None = None
    if not _may_be_wide(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:  # invalid JSON, invalid UTF-8, nesting too deep...
            first_error = exc
    try:  # ...or only what orjson refuses or misreads: UTF-16/32, lone surrogates, NaN, 2**70
        return json.loads(body, parse_constant=_NonFinite, parse_float=_float)
    except (ValueError, RecursionError) as exc:
        raise ValueError(str(first_error or exc)) from None


def encode_document(document: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document)
    except (orjson.JSONEncodeError, TypeError):  # lone surrogates, NaN, integers beyond 64 bits:
        pass  # what json.loads accepts; and nesting deeper than orjson writes (254; reads 1024)
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
    for name in xargs:
        if isinstance(name, str) and name.startswith(XARGS_PREFIX):
            raise reserved_entry_error(f"{XARGS}.{name}")


def _check_flagged_options(document: dict[str, Any]) -> None:
    """The single place for request options that cannot be combined with the flag (``document``
    has its planned fields read as vLLM reads them)."""
    if document.get("use_beam_search") is True:  # vLLM's beam search drops vllm_xargs
        raise bad_request(
            f"'use_beam_search': true is not supported together with {KV}.{FLAG}.",
            "use_beam_search",
        )


def check_choice(value: Any, param: str, allowed: Sequence[str]) -> str:
    """``value`` if one of ``allowed``, else a 400 naming ``param``."""
    try:
        return request_fields.check_choice(value, param, allowed)
    except RequestFieldError as exc:
        raise bad_request(exc.message, exc.param) from None


def _vector_request(kv: dict[str, Any]) -> tuple[bool, VectorRequest]:
    """The flag and what it asks for, checked by the rules the client module applies too."""
    try:
        return request_fields.vector_request(kv)
    except RequestFieldError as exc:
        raise bad_request(exc.message, exc.param) from None


def inspect_body(body: bytes, fields: PlannedFields = CHAT_FIELDS) -> Decision:
    """Decide what to do with a ``POST /v1/chat/completions``, ``/v1/completions`` or
    ``/v1/responses`` body; ``fields``: that endpoint's fields the proxy plans with.

    Raises ``ProxyError`` (400) for bodies the proxy refuses.
    """
    if not needs_inspection(body):
        return Ordinary(body)
    document = parse_object(body)
    _check_xargs(document)
    kv = document.get(KV)
    if kv is None:
        return Ordinary(body)
    if not isinstance(kv, dict):
        raise bad_request(f"'{KV}' must be a JSON object.", KV)
    if not any(name in kv for name in OWN_FIELDS):
        return Ordinary(body)
    flag, request = _vector_request(kv)
    _check_depth(body, document)  # from here on the document is re-encoded
    stripped = _without_own_fields(document, kv)
    if not flag:
        return Ordinary(encode_document(stripped))
    planned = read_planned_fields(stripped, fields)
    _check_flagged_options(planned)
    return Flagged(planned, request)


async def check_other_endpoint(body: bytes, content_type: bytes | None) -> ProxyError | None:
    """For other endpoints: refuse any way in for a reserved entry (see
    :mod:`.reserved_entries`: an allow-list of bodies that may reach vLLM unchanged), and the
    flag (a flagged request must never get a 200 without its vector); otherwise stay out of
    the way."""
    if content_type is not None and is_form(content_type):
        if not could_spell_reserved(body, content_type):
            return None
        return await form_refusal(body, content_type)
    if not needs_inspection(body):
        return None
    try:
        document = _load(body)
    except ValueError:  # vLLM cannot read it either, unless it spells the prefix as it is
        spelled = XARGS_PREFIX.encode("ascii") in body
        return unreadable_refusal() if spelled else None
    refusal = json_refusal(document)
    if refusal is not None:
        return refusal
    kv = document.get(KV) if isinstance(document, dict) else None
    if isinstance(kv, dict) and kv.get(FLAG, False) is not False:
        return bad_request(
            f"'{KV}.{FLAG}' is supported on POST /v1/chat/completions (and its /batch), POST "
            "/v1/completions and POST /v1/responses only (and /v1/embeddings returns vectors by "
            "design).",
            f"{KV}.{FLAG}",
        )
    return None


def _without_own_fields(document: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy without the proxy's fields; ``kv_transfer_params`` dropped if left empty."""
    result = dict(document)
    rest = {k: v for k, v in kv.items() if k not in OWN_FIELDS}
    if rest:
        result[KV] = rest
    else:
        del result[KV]
    return result
