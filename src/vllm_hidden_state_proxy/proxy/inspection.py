"""Request inspection: is this chat/completions body flagged, and is it valid? (no I/O)

A body is only JSON-parsed when its raw bytes could spell one of the names the proxy cares
about: its own ``kv_transfer_params`` fields, its reserved ``vllm_xargs`` entries, or any JSON
``\\u`` escape (which could spell either in a way a plain substring search would miss), or when
it is not UTF-8 at all (UTF-16/32 JSON, which vLLM's parser accepts and a byte search cannot
read). Everything else is :class:`Ordinary` and goes to vLLM byte for byte.

Parsing uses orjson, with Python's ``json`` (what vLLM itself uses) as the fallback for what
orjson refuses but vLLM accepts: UTF-16/32, lone surrogate escapes, NaN, huge numbers.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from vllm_hidden_state_proxy.protocol import (
    LAYERS_ENTRY,
    POOLING_ENTRY,
    POOLINGS,
    REQUEST_KEY_ENTRY,
    XARGS_PREFIX,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request
from vllm_hidden_state_proxy.proxy.reserved_entries import (
    could_spell_reserved,
    form_refusal,
    is_form,
    json_refusal,
    reserved_entry_error,
    unreadable_refusal,
)
from vllm_hidden_state_proxy.ring import MAX_LAYERS, RingShape

KV = "kv_transfer_params"
XARGS = "vllm_xargs"
FLAG = "return_last_hidden_state"
FORMAT = "last_hidden_state_format"
INFO = "last_hidden_state_info"
LAYERS = "last_hidden_state_layers"
POOLING = "last_hidden_state_pooling"
#: The client-facing fields the proxy owns inside ``kv_transfer_params`` (stripped before vLLM).
OWN_FIELDS = (FLAG, FORMAT, INFO, LAYERS, POOLING)
FORMATS = ("float", "base64")

#: Deepest nesting of a body the proxy re-encodes. Beyond orjson's 254 levels ``json.dumps``
#: takes over, which recurses on the Python stack and fails near 1000 levels (orjson reads up to
#: 1024, so such a body would otherwise parse and then crash the proxy).
MAX_DEPTH = 512

# Every own field contains "last_hidden_state", so one marker covers them all.
_MARKERS = (b"last_hidden_state", XARGS_PREFIX.encode("ascii"), b"\\u")


@dataclass(frozen=True)
class VectorRequest:
    """What a flagged request asks for, as the client wrote it."""

    format: str = "float"
    info: bool = False
    #: ``last_hidden_state_layers`` as given (negative indices count from the end); ``None``
    #: when absent: the final layer, in the singular field only.
    layers: tuple[int, ...] | None = None
    pooling: str = "last"


@dataclass(frozen=True)
class WantedVectors:
    """A :class:`VectorRequest` resolved against the server's rings: absolute layer indices."""

    request: VectorRequest
    #: One absolute index per requested layer, in request order (default: the final layer).
    layers: tuple[int, ...]
    #: The final layer's index (N): its vector also goes in ``last_hidden_state``.
    final_layer: int

    @property
    def distinct_layers(self) -> tuple[int, ...]:
        """The layers to capture, ascending, each once."""
        return tuple(sorted(set(self.layers)))


@dataclass(frozen=True)
class Ordinary:
    """Send this body upstream as an ordinary request (``body`` may be the original bytes)."""

    body: bytes


@dataclass(frozen=True)
class Flagged:
    """A valid flagged request; ``document`` already has the proxy's own fields stripped."""

    document: dict[str, Any]
    vectors: VectorRequest = VectorRequest()


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


def _load(body: bytes) -> Any:
    """Parse like vLLM would; raises ``ValueError`` if neither parser accepts the body."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # invalid JSON, invalid UTF-8, nesting too deep...
        first_error = exc
    try:  # ...or only what orjson refuses: UTF-16/32, lone surrogates, NaN
        return json.loads(body, parse_constant=_NonFinite)
    except (ValueError, RecursionError):
        raise ValueError(str(first_error)) from None


def encode_document(document: dict[str, Any]) -> bytes:
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
    for name in xargs:
        if isinstance(name, str) and name.startswith(XARGS_PREFIX):
            raise reserved_entry_error(f"{XARGS}.{name}")


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_format(value: Any, param: str) -> str:
    if not isinstance(value, str) or value not in FORMATS:
        raise bad_request(f"'{param}' must be one of {', '.join(FORMATS)}, not {value!r}.", param)
    return value


def check_pooling(value: Any, param: str) -> str:
    if not isinstance(value, str) or value not in POOLINGS:
        raise bad_request(f"'{param}' must be one of {', '.join(POOLINGS)}, not {value!r}.", param)
    return value


def _vector_request(kv: dict[str, Any]) -> tuple[bool, VectorRequest]:
    """The flag and what it asks for, type-checked (each error names its field)."""
    flag = kv.get(FLAG, False)
    if not isinstance(flag, bool):
        raise bad_request(f"'{KV}.{FLAG}' must be a boolean.", f"{KV}.{FLAG}")
    fmt = check_format(kv.get(FORMAT, "float"), f"{KV}.{FORMAT}")
    info = kv.get(INFO, False)
    if not isinstance(info, bool):
        raise bad_request(f"'{KV}.{INFO}' must be a boolean.", f"{KV}.{INFO}")
    layers = kv.get(LAYERS)
    if isinstance(layers, list) and len(layers) > MAX_LAYERS:  # before any work per entry
        raise bad_request(
            f"'{KV}.{LAYERS}' has {len(layers)} entries; at most {MAX_LAYERS} are allowed (the "
            "most layers a server can capture).",
            f"{KV}.{LAYERS}",
        )
    if layers is not None and (
        not isinstance(layers, list) or not layers or not all(_is_int(k) for k in layers)
    ):
        raise bad_request(
            f"'{KV}.{LAYERS}' must be a non-empty list of layer indices (integers; negative "
            "ones count from the end, -1 is the final layer after the final norm).",
            f"{KV}.{LAYERS}",
        )
    pooling = check_pooling(kv.get(POOLING, "last"), f"{KV}.{POOLING}")
    # Each label once, in the order first given: they are the answer's keys.
    requested = None if layers is None else tuple(dict.fromkeys(layers))
    return flag, VectorRequest(fmt, info, requested, pooling)


def inspect_body(body: bytes) -> Decision:
    """Decide what to do with a ``POST /v1/chat/completions`` or ``/v1/completions`` body.

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
    _check_flagged_options(stripped)
    return Flagged(stripped, request)


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
            f"'{KV}.{FLAG}' is supported on POST /v1/chat/completions, POST /v1/completions "
            "and POST /v1/responses only (and /v1/embeddings returns vectors by design).",
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


# ---------------------------------------------------------------------------------------------
# Against the server's rings
# ---------------------------------------------------------------------------------------------


def resolve_layers(
    request: VectorRequest, shapes: Sequence[RingShape], param: str = f"{KV}.{LAYERS}"
) -> WantedVectors:
    """Absolute layer indices for ``request`` on rings of ``shapes`` (at least one).

    Raises 400 listing the captured layers for a layer the server does not capture.
    """
    shape = shapes[0]
    final = shape.num_hidden_layers
    captured = set(shape.layers)
    for other in shapes[1:]:
        captured &= set(other.layers)
    asked = request.layers if request.layers is not None else (-1,)
    resolved = []
    for layer in asked:
        absolute = layer + final + 1 if layer < 0 else layer
        if absolute not in captured or absolute < 0:
            listed = ", ".join(str(k) for k in sorted(captured))
            raise bad_request(
                f"Layer {layer} is not captured by this server. It captures layers {listed} "
                f"(the model has {final} decoder layers; -1 means {final}, the final layer "
                "after the final norm). Choose from those, or restart vLLM with the layer in "
                "--hidden-state-layers (HIDDEN_STATE_PROXY_LAYERS).",
                param,
            )
        resolved.append(absolute)
    return WantedVectors(request, tuple(resolved), final)


def flagged_body(document: dict[str, Any], wire_key: str, wanted: WantedVectors) -> bytes:
    """The body sent to vLLM for a flagged request: its request key and what to capture in
    ``vllm_xargs``; a mean-pooled request also gets a fresh ``cache_salt``, since the hook must
    see every prompt position and the prefix cache would skip the cached ones."""
    xargs = document.get(XARGS)
    merged = dict(xargs) if isinstance(xargs, dict) else {}
    merged[REQUEST_KEY_ENTRY] = wire_key
    layers = wanted.distinct_layers
    if layers != (wanted.final_layer,):
        merged[LAYERS_ENTRY] = list(layers)
    if wanted.request.pooling != "last":
        merged[POOLING_ENTRY] = wanted.request.pooling
    sent = {**document, XARGS: merged}
    if wanted.request.pooling == "mean":
        sent["cache_salt"] = secrets.token_hex(16)
    return encode_document(sent)


def parse_completion(body: bytes) -> dict[str, Any] | None:
    """vLLM's 200 JSON response as a dict, or ``None`` if it is not a JSON object."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return document if isinstance(document, dict) else None
