"""A flagged request's own fields, checked: the one set of rules the proxy applies (a 400) and
the client module applies before sending (:func:`client.hidden_state_fields`).

Imports nothing of the project but ``protocol.py`` and needs nothing beyond the standard
library: the client-only install (numpy alone) imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from vllm_hidden_state_proxy.protocol import (
    DTYPE,
    DTYPES,
    FLAG,
    FORMAT,
    FORMATS,
    INFO,
    KV,
    LAYERS,
    MATRIX_POOLINGS,
    MAX_LAYERS,
    MAX_SPAN_POSITION,
    MAX_SPANS,
    POOLING,
    REQUESTED_POOLINGS,
    SPANS,
    SPANS_POOLING,
)


class RequestFieldError(ValueError):
    """A field the proxy refuses (a 400); ``param`` names it as the error body does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class VectorRequest:
    """What a flagged request asks for, as the client wrote it."""

    format: str = "float"
    info: bool = False
    #: ``last_hidden_state_layers`` as given (negative indices count from the end); ``None``
    #: when absent: the final layer, in the singular field only.
    layers: tuple[int, ...] | None = None
    pooling: str = "last"
    #: Of base64 values (``"float"`` lists are always float32).
    dtype: str = "float32"
    #: ``last_hidden_state_spans``: ``(start, end)`` token positions, each mean-pooled.
    spans: tuple[tuple[int, int], ...] | None = None

    @property
    def record_pooling(self) -> str:
        """The pooling of the record the hook publishes for it (the pooling entry's)."""
        return SPANS_POOLING if self.spans is not None else self.pooling


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer (``True`` is an ``int`` to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: Any) -> bool:
    """A non-empty list of token ids (JSON integers). (The set of the items' types is built in
    C: a 5th of the time of a generator over thousands of ids.)"""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def _is_list(value: Any) -> TypeGuard[Sequence[Any]]:
    """A JSON array: a list, or (from Python callers) a tuple."""
    return isinstance(value, (list, tuple))


def check_choice(value: Any, param: str, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise RequestFieldError(
            f"'{param}' must be one of {', '.join(allowed)}, not {value!r}.", param
        )
    return value


def vector_request(kv: dict[str, Any]) -> tuple[bool, VectorRequest]:
    """The flag and what it asks for, from ``kv_transfer_params``, type-checked (each error
    names its field). Absent fields take their defaults."""
    flag = kv.get(FLAG, False)
    if not isinstance(flag, bool):
        raise RequestFieldError(f"'{KV}.{FLAG}' must be a boolean.", f"{KV}.{FLAG}")
    spans = _spans(kv.get(SPANS))
    pooling = check_choice(
        kv.get(POOLING, "last" if spans is None else "mean"), f"{KV}.{POOLING}", REQUESTED_POOLINGS
    )
    if spans is not None and pooling != "mean":
        raise RequestFieldError(
            f"'{KV}.{SPANS}' are mean-pooled: they need '{KV}.{POOLING}': 'mean', not {pooling!r}.",
            f"{KV}.{SPANS}",
        )
    # Matrices are base64 unless the client asks for lists: they can be megabytes.
    default_format = "base64" if pooling in MATRIX_POOLINGS or spans is not None else "float"
    fmt = check_choice(kv.get(FORMAT, default_format), f"{KV}.{FORMAT}", FORMATS)
    dtype = check_choice(kv.get(DTYPE, "float32"), f"{KV}.{DTYPE}", DTYPES)
    if dtype != "float32" and fmt != "base64":
        raise RequestFieldError(
            f"'{KV}.{DTYPE}': {dtype!r} needs '{KV}.{FORMAT}': 'base64' (JSON lists are float32).",
            f"{KV}.{DTYPE}",
        )
    info = kv.get(INFO, False)
    if not isinstance(info, bool):
        raise RequestFieldError(f"'{KV}.{INFO}' must be a boolean.", f"{KV}.{INFO}")
    return flag, VectorRequest(fmt, info, _layers(kv.get(LAYERS)), pooling, dtype, spans)


def _layers(value: Any) -> tuple[int, ...] | None:
    """``last_hidden_state_layers``: each label once, in the order first given (they are the
    answer's keys); ``None`` when absent."""
    if value is None:
        return None
    param = f"{KV}.{LAYERS}"
    if _is_list(value) and len(value) > MAX_LAYERS:  # before any work per entry
        raise RequestFieldError(
            f"'{param}' has {len(value)} entries; at most {MAX_LAYERS} are allowed (the "
            "most layers a server can capture).",
            param,
        )
    if not _is_list(value) or not value or not all(is_int(k) for k in value):
        raise RequestFieldError(
            f"'{param}' must be a non-empty list of layer indices (integers; negative "
            "ones count from the end, -1 is the final layer after the final norm).",
            param,
        )
    return tuple(dict.fromkeys(value))


def _spans(value: Any) -> tuple[tuple[int, int], ...] | None:
    """``last_hidden_state_spans``, checked: 1 to ``MAX_SPANS`` pairs ``[start, end]`` of token
    positions, ``0 <= start < end``; ``None`` when absent. (That ``end`` is within the prompt
    is the hook's to check: only vLLM has tokenized it.)"""
    if value is None:
        return None
    param = f"{KV}.{SPANS}"
    if _is_list(value) and len(value) > MAX_SPANS:
        raise RequestFieldError(
            f"'{param}' has {len(value)} spans; at most {MAX_SPANS} are allowed.", param
        )
    if not _is_list(value) or not value:
        raise RequestFieldError(f"'{param}' must be a non-empty list of [start, end] pairs.", param)
    spans = []
    for span in value:
        if (
            not _is_list(span)
            or len(span) != 2
            or not all(is_int(p) for p in span)
            or not 0 <= span[0] < span[1] <= MAX_SPAN_POSITION
        ):
            raise RequestFieldError(
                f"'{param}' entries must be [start, end] token positions of the prompt with "
                f"0 <= start < end (end exclusive), not {span!r}.",
                param,
            )
        spans.append((span[0], span[1]))
    return tuple(spans)
