"""The request's fields: :func:`hidden_state_fields`, checked as the proxy checks them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hidden_state_proxy.client.types import Dtype, Format, HiddenStateRequestError, Pooling
from vllm_hidden_state_proxy.client.types import is_int as _is_int
from vllm_hidden_state_proxy.protocol import (
    DTYPE,
    DTYPES,
    FLAG,
    FORMAT,
    FORMATS,
    INFO,
    KV,
    LAYERS,
    MAX_LAYERS,
    MAX_SPAN_POSITION,
    MAX_SPANS,
    POOLING,
    REQUESTED_POOLINGS,
    SPANS,
)


def _field(name: str) -> str:
    return f"{KV}.{name}"


def hidden_state_fields(
    *,
    layers: Sequence[int] | None = None,
    pooling: Pooling | None = None,
    spans: Sequence[Sequence[int]] | None = None,
    format: Format = "base64",
    dtype: Dtype = "float32",
    info: bool = False,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The body fields asking for hidden states: ``{"kv_transfer_params": {...}}``, to pass as
    the OpenAI SDK's ``extra_body`` (or merge into a JSON body).

    ``layers``: Transformers' ``hidden_states`` indices (``-1``: the final layer after the
    final norm), each once; default the final layer only. ``pooling``: default ``"last"``
    (``"mean"`` with ``spans``). ``spans``: ``[start, end)`` token positions of the prompt,
    each mean-pooled into one row. ``format``: ``"base64"`` by default here (exact, keeps
    non-finite values, smaller); ``dtype``: of base64 values. ``kv_transfer_params``: other
    entries of that object to keep (vLLM's own).

    Raises :class:`HiddenStateRequestError` for what the proxy would refuse with a 400 (the
    captured layers are the server's to check: :func:`read_capture` lists them).
    """
    kv: dict[str, Any] = dict(kv_transfer_params or {})
    kv[FLAG] = True
    if spans is not None:
        checked_spans = _checked_spans(spans)
        kv[SPANS] = checked_spans
    if pooling is None:
        pooling = "mean" if spans is not None else "last"
    if pooling not in REQUESTED_POOLINGS:
        raise HiddenStateRequestError(
            f"'{_field(POOLING)}' must be one of {', '.join(REQUESTED_POOLINGS)}, not {pooling!r}.",
            _field(POOLING),
        )
    if spans is not None and pooling != "mean":
        raise HiddenStateRequestError(
            f"'{_field(SPANS)}' are mean-pooled: they need '{_field(POOLING)}': 'mean', not "
            f"{pooling!r}.",
            _field(SPANS),
        )
    kv[POOLING] = pooling
    if format not in FORMATS:
        raise HiddenStateRequestError(
            f"'{_field(FORMAT)}' must be one of {', '.join(FORMATS)}, not {format!r}.",
            _field(FORMAT),
        )
    kv[FORMAT] = format
    if dtype not in DTYPES:
        raise HiddenStateRequestError(
            f"'{_field(DTYPE)}' must be one of {', '.join(DTYPES)}, not {dtype!r}.", _field(DTYPE)
        )
    if dtype != "float32" and format != "base64":
        raise HiddenStateRequestError(
            f"'{_field(DTYPE)}': {dtype!r} needs '{_field(FORMAT)}': 'base64' (JSON lists are "
            "float32).",
            _field(DTYPE),
        )
    if dtype != "float32":
        kv[DTYPE] = dtype
    if not isinstance(info, bool):
        raise HiddenStateRequestError(f"'{_field(INFO)}' must be a boolean.", _field(INFO))
    if info:
        kv[INFO] = True
    if layers is not None:
        kv[LAYERS] = _checked_layers(layers)
    return {KV: kv}


def _checked_layers(layers: Sequence[int]) -> list[int]:
    param = _field(LAYERS)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise HiddenStateRequestError(f"'{param}' must be a list of layer indices.", param)
    if len(layers) > MAX_LAYERS:
        raise HiddenStateRequestError(
            f"'{param}' has {len(layers)} entries; at most {MAX_LAYERS} are allowed (the most "
            "layers a server can capture).",
            param,
        )
    if not layers or not all(_is_int(k) for k in layers):
        raise HiddenStateRequestError(
            f"'{param}' must be a non-empty list of layer indices (integers; negative ones "
            "count from the end, -1 is the final layer after the final norm).",
            param,
        )
    return list(dict.fromkeys(layers))  # each once, in the order given: the answer's keys


def _checked_spans(spans: Sequence[Sequence[int]]) -> list[list[int]]:
    param = _field(SPANS)
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence) or not spans:
        raise HiddenStateRequestError(
            f"'{param}' must be a non-empty list of [start, end] pairs.", param
        )
    if len(spans) > MAX_SPANS:
        raise HiddenStateRequestError(
            f"'{param}' has {len(spans)} spans; at most {MAX_SPANS} are allowed.", param
        )
    checked = []
    for span in spans:
        pair = list(span) if isinstance(span, Sequence) and not isinstance(span, str) else None
        if (
            pair is None
            or len(pair) != 2
            or not all(_is_int(p) for p in pair)
            or not 0 <= pair[0] < pair[1] <= MAX_SPAN_POSITION
        ):
            raise HiddenStateRequestError(
                f"'{param}' entries must be [start, end] token positions of the prompt with "
                f"0 <= start < end (end exclusive), not {span!r}.",
                param,
            )
        checked.append(pair)
    return checked
