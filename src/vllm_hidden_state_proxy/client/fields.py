"""The request's fields: :func:`hidden_state_fields`, checked by the proxy's own rules
(:mod:`vllm_hidden_state_proxy.request_fields`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hidden_state_proxy.client.types import Dtype, Format, HiddenStateRequestError, Pooling
from vllm_hidden_state_proxy.protocol import DTYPE, FLAG, FORMAT, INFO, KV, LAYERS, POOLING, SPANS
from vllm_hidden_state_proxy.request_fields import RequestFieldError, vector_request


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
    asked: dict[str, Any] = {FORMAT: format, DTYPE: dtype, INFO: info}
    if pooling is not None:
        asked[POOLING] = pooling
    if spans is not None:
        asked[SPANS] = spans
    if layers is not None:
        asked[LAYERS] = layers
    try:
        _, request = vector_request({FLAG: True, **asked})
    except RequestFieldError as exc:
        raise HiddenStateRequestError(exc.message, exc.param) from None
    kv[POOLING] = request.pooling
    kv[FORMAT] = request.format
    if request.spans is not None:
        kv[SPANS] = [list(span) for span in request.spans]
    if request.dtype != "float32":
        kv[DTYPE] = request.dtype
    if request.info:
        kv[INFO] = True
    if request.layers is not None:
        kv[LAYERS] = list(request.layers)  # each once, in the order given: the answer's keys
    return {KV: kv}
