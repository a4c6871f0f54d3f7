"""Which client bodies may reach vLLM unchanged on the routes the proxy does not own.

The request key is a ``vllm_xargs`` entry named ``hidden_state_proxy_*``; whoever could set
one could make the hook take their request for another request's sibling. vLLM turns client
input into ``SamplingParams.extra_args`` in more places than chat and completions: a JSON
``vllm_xargs`` (responses, Anthropic messages, ...), ``sampling_params.extra_args`` of the
token-in/token-out ``/inference/v1/generate``, and a ``vllm_xargs`` *form field* holding JSON
(``/v1/audio/transcriptions`` and ``/translations``, multipart). New routes come with new
releases, so the rule is an allow-list of bodies, not a list of known places:

- a body whose bytes, as vLLM may decode them, cannot spell the reserved prefix passes
  (almost every body: one byte search; JSON ``\\u`` escapes, UTF-16/32 JSON, a form's
  percent-encoding or its declared charset could spell it, so those are read first);
- a JSON body passes if no object key at any depth starts with the prefix;
- a form passes if none of its ``vllm_xargs`` fields, read as vLLM reads them (Starlette's
  parser, its charset, then JSON), holds such a key, and no field name starts with it;
- anything else that spells the prefix is refused: the proxy cannot prove it harmless.

Refusals are 400s naming where the entry was found.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from starlette.datastructures import Headers
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

from vllm_hidden_state_proxy.protocol import XARGS, XARGS_PREFIX
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request

_PREFIX = XARGS_PREFIX.encode("ascii")
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
#: Charsets in which the prefix is spelled by its ASCII bytes (Starlette's default is UTF-8).
_ASCII_LIKE = ("", "utf-8", "utf8", "us-ascii", "ascii", "latin-1", "iso-8859-1")


def reserved_key_in(document: Any) -> str | None:
    """The path of the first object key, at any depth, that starts with the reserved prefix
    (``sampling_params.extra_args.hidden_state_proxy_key``), or ``None``."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and key.startswith(XARGS_PREFIX):
                    return where
                if isinstance(child, (dict, list)):
                    stack.append((child, where))
        elif isinstance(value, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(value))
    return None


def reserved_entry_error(where: str) -> ProxyError:
    return bad_request(
        f"'{where}' is reserved for the hidden-state proxy (entries named {XARGS_PREFIX}*); "
        "remove it.",
        where.split(".", 1)[0].split("[", 1)[0],
    )


def _media_type(content_type: bytes | None) -> tuple[str, str]:
    """(media type, charset), lower-cased; empty strings where absent."""
    if not content_type:
        return "", ""
    parts = content_type.decode("latin-1").split(";")
    charset = ""
    for param in parts[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    return parts[0].strip().lower(), charset


def could_spell_reserved(body: bytes, content_type: bytes | None) -> bool:
    """Cheap pre-filter: could vLLM read a reserved name out of this body?"""
    media, charset = _media_type(content_type)
    if charset not in _ASCII_LIKE:
        return True
    if media == "application/x-www-form-urlencoded":
        return _PREFIX in body or b"\\u" in body or b"%" in body
    if media == "multipart/form-data":  # names and values are not percent-decoded there
        return _PREFIX in body or b"\\u" in body
    return _PREFIX in body or b"\\u" in body or b"\x00" in body[:4] or body[:2] in _BOMS


_BOMS = (b"\xff\xfe", b"\xfe\xff")


async def _one_chunk(body: bytes) -> AsyncGenerator[bytes, None]:
    yield body


async def _form_fields(body: bytes, content_type: bytes) -> list[tuple[str, str | None]]:
    """(name, text value or ``None`` for a file) of each field of a form, as vLLM's Starlette
    reads them (raises ``MultiPartException``)."""
    headers = Headers(raw=[(b"content-type", content_type)])
    media, _ = _media_type(content_type)
    parser: FormParser | MultiPartParser
    if media == "multipart/form-data":
        parser = MultiPartParser(headers, _one_chunk(body))
    else:
        parser = FormParser(headers, _one_chunk(body))
    form = await parser.parse()
    try:
        return [
            (name, value if isinstance(value, str) else None) for name, value in form.multi_items()
        ]
    finally:
        await form.close()


async def form_refusal(body: bytes, content_type: bytes) -> ProxyError | None:
    try:
        fields = await _form_fields(body, content_type)
    except (MultiPartException, ValueError, LookupError):
        return bad_request(
            f"The form mentions a name reserved for the hidden-state proxy ({XARGS_PREFIX}*) "
            "in a way the proxy cannot read; remove it."
        )
    for name, value in fields:
        if name.startswith(XARGS_PREFIX):
            return reserved_entry_error(name)
        if name != XARGS or value is None:  # the field vLLM reads as JSON into extra_args
            continue
        try:
            document = json.loads(value)
        except ValueError:
            continue  # not what vLLM accepts either: it answers 400 itself
        where = reserved_key_in(document)
        if where is not None:
            return reserved_entry_error(f"{XARGS}.{where}")
    return None


def json_refusal(document: Any) -> ProxyError | None:
    where = reserved_key_in(document)
    return None if where is None else reserved_entry_error(where)


def unreadable_refusal() -> ProxyError:
    return bad_request(
        f"The body mentions a name reserved for the hidden-state proxy ({XARGS_PREFIX}*) and is "
        "neither JSON nor a form the proxy can read; remove it."
    )


def is_form(content_type: bytes) -> bool:
    return _media_type(content_type)[0] in _FORMS
