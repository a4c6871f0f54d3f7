"""The fields of a flagged request the proxy plans with, read as vLLM reads them.

vLLM reads a request body into a pydantic model in lax mode: ``"n": "2"`` and ``2.0`` are 2,
``"stream": 1`` and ``"yes"`` are ``true``. The proxy decides from some of the same fields how
many choices to find, whether to ask for token ids or usage, whether to fan a prompt list out,
how many rows a matrix may have. If it read them more strictly than vLLM, the worker hook
would see a different request than the one the proxy planned (two choices where the proxy
looks for one: choice 0 would get another choice's state). So before planning, each of these
fields is read here with the type vLLM's model declares for it (``vllm/entrypoints/openai/
*/protocol.py``, pydantic's own validators), and the body sent to vLLM carries the value as
read, which vLLM reads the same. A value vLLM's type refuses is a 400 naming the field (vLLM
would refuse it too).

Only the fields the proxy plans with are here; every other field goes to vLLM as the client
wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from vllm_hidden_state_proxy.proxy.errors import bad_request

_INT = TypeAdapter(int)
_OPTIONAL_INT = TypeAdapter(int | None)
_BOOL = TypeAdapter(bool)
_OPTIONAL_BOOL = TypeAdapter(bool | None)
_TOKEN_ID = Annotated[int, Field(ge=0)]
#: ``CompletionRequest.prompt``.
_PROMPT = TypeAdapter(list[_TOKEN_ID] | list[list[_TOKEN_ID]] | str | list[str] | None)

STREAM_OPTIONS = "stream_options"
#: ``StreamOptions`` (both ``bool | None``), read when ``stream_options`` is an object (vLLM
#: refuses anything else with its own 400).
_STREAM_OPTIONS: Mapping[str, TypeAdapter[Any]] = {
    "include_usage": _OPTIONAL_BOOL,
    "continuous_usage_stats": _OPTIONAL_BOOL,
}


@dataclass(frozen=True)
class PlannedFields:
    """One endpoint's fields the proxy plans with, each with the type of vLLM's model."""

    types: Mapping[str, TypeAdapter[Any]]
    stream_options: bool = False


#: ``ChatCompletionRequest``.
CHAT_FIELDS = PlannedFields(
    {
        "n": _OPTIONAL_INT,
        "max_tokens": _OPTIONAL_INT,
        "max_completion_tokens": _OPTIONAL_INT,
        "stream": _OPTIONAL_BOOL,
        "echo": _BOOL,
        "include_reasoning": _BOOL,
        "use_beam_search": _BOOL,
        "return_token_ids": _OPTIONAL_BOOL,
    },
    stream_options=True,
)
#: ``CompletionRequest``.
COMPLETIONS_FIELDS = PlannedFields(
    {
        "n": _INT,
        "max_tokens": _OPTIONAL_INT,
        "stream": _OPTIONAL_BOOL,
        "echo": _OPTIONAL_BOOL,
        "use_beam_search": _BOOL,
        "return_token_ids": _OPTIONAL_BOOL,
        "prompt": _PROMPT,
    },
    stream_options=True,
)
#: ``ResponsesRequest`` (its other fields the proxy does not plan with; ``n``, ``echo`` and
#: the like are extra fields there, which vLLM ignores).
RESPONSES_FIELDS = PlannedFields({"stream": _OPTIONAL_BOOL})


def _read(adapter: TypeAdapter[Any], value: Any, param: str) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        reason = exc.errors(include_url=False)[0]["msg"]
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise bad_request(f"'{param}': {reason} (as vLLM reads it), not {shown}.", param) from None


def _as_written(name: str, value: Any) -> bool:
    """Whether vLLM reads ``value`` as it is (or refuses it itself), known without pydantic: a
    prompt of text or of token ids (validating thousands of token ids costs ~0.3 us each, this
    ~0.01; a negative id vLLM refuses with its own 400)."""
    if name != "prompt" or isinstance(value, str):
        return name == "prompt"
    if not isinstance(value, list) or not value:
        return False
    types = set(map(type, value))
    return types == {str} or types == {int}


def read_planned_fields(document: dict[str, Any], fields: PlannedFields) -> dict[str, Any]:
    """``document`` (a shallow copy where anything changed) with each field of ``fields``
    as vLLM reads it; ``ProxyError`` 400 naming the field vLLM's type refuses."""
    read = document
    for name, adapter in fields.types.items():
        if name in document and not _as_written(name, document[name]):
            value = _read(adapter, document[name], name)
            if value is not document[name]:
                read = read if read is not document else dict(document)
                read[name] = value
    options = document.get(STREAM_OPTIONS)
    if fields.stream_options and isinstance(options, dict):
        read_options = {
            name: _read(adapter, options[name], f"{STREAM_OPTIONS}.{name}")
            for name, adapter in _STREAM_OPTIONS.items()
            if name in options
        }
        if any(read_options[name] is not options[name] for name in read_options):
            read = read if read is not document else dict(document)
            read[STREAM_OPTIONS] = {**options, **read_options}
    return read
