"""What one keyed request asks the worker hook for, and how its record is described: shared by
the proxy (``proxy/``) and the offline API (``offline.py``), which must ask and describe alike.

- :class:`WantedVectors`: a :class:`~vllm_hidden_state_proxy.request_fields.VectorRequest`
  resolved against the rings' layers (:func:`resolve_layers`);
- :func:`xargs_entries`: the ``vllm_xargs`` (``SamplingParams.extra_args``) entries that carry
  the request key and what to capture to the hook;
- :func:`vector_info`: ``last_hidden_state_info`` of a record;
- :func:`as_dtype`: a record's float32 values rounded to the dtype asked for.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from vllm_hidden_state_proxy.protocol import (
    KV,
    LAYERS,
    LAYERS_ENTRY,
    MATRIX_POOLINGS,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    SPANS_ENTRY,
    absolute_layer,
)
from vllm_hidden_state_proxy.request_fields import RequestFieldError, VectorRequest
from vllm_hidden_state_proxy.ring.records import Record, Rows


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


def resolve_layers(
    request: VectorRequest,
    num_hidden_layers: int,
    captured: Collection[int],
    param: str = f"{KV}.{LAYERS}",
) -> WantedVectors:
    """Absolute layer indices for ``request`` on rings of a model of ``num_hidden_layers``
    decoder layers that capture ``captured``; :class:`RequestFieldError` (naming ``param``)
    listing the captured layers for a layer they do not capture."""
    resolved = []
    for layer in request.layers if request.layers is not None else (-1,):
        absolute = absolute_layer(layer, num_hidden_layers)
        if absolute is None or absolute not in captured:
            listed = ", ".join(str(k) for k in sorted(captured))
            raise RequestFieldError(
                f"Layer {layer} is not captured by this server. It captures layers {listed} "
                f"(the model has {num_hidden_layers} decoder layers; -1 means "
                f"{num_hidden_layers}, the final layer after the final norm). Choose from "
                "those, or restart vLLM with the layer in --hidden-state-layers "
                "(HIDDEN_STATE_PROXY_LAYERS).",
                param,
            )
        resolved.append(absolute)
    return WantedVectors(request, tuple(resolved), num_hidden_layers)


def xargs_entries(wire_key: str, wanted: WantedVectors) -> dict[str, Any]:
    """The ``vllm_xargs`` entries of a keyed request: its request key and, where they differ
    from the hook's defaults (the final layer, ``"last"``), the layers, pooling and spans."""
    entries: dict[str, Any] = {REQUEST_KEY_ENTRY: wire_key}
    layers = wanted.distinct_layers
    if layers != (wanted.final_layer,):
        entries[LAYERS_ENTRY] = list(layers)
    pooling = wanted.request.record_pooling
    if pooling != "last":
        entries[POOLING_ENTRY] = pooling
    if wanted.request.spans is not None:
        entries[SPANS_ENTRY] = [position for span in wanted.request.spans for position in span]
    return entries


def vector_info(record: Record, wanted: WantedVectors) -> dict[str, Any]:
    """``last_hidden_state_info``: where and what the record's vectors are."""
    request = wanted.request
    info: dict[str, Any] = {
        "position": record.position,
        "num_prompt_tokens": record.num_prompt_tokens,
        "hidden_size": record.hidden_size,
        "dtype": request.dtype if request.format == "base64" else "float32",
        "pooling": request.pooling,
    }
    if request.spans is not None:
        info["spans"] = [list(span) for span in request.spans]
    if record.pooling == "last_answer":  # the state that chose this token of the answer
        info["num_output_tokens"] = record.position - record.num_prompt_tokens + 2
    if record.pooling in MATRIX_POOLINGS:  # rows of positions position, position + 1, ...
        info["rows"] = record.rows
    if record.pooling == "all_answer":
        info["num_output_tokens"] = record.rows
    if wanted.final_layer in wanted.layers:
        info["layer"] = "final_norm"
    if wanted.request.layers is not None:
        info["layers"] = list(wanted.request.layers)
    return info


def bfloat16_bits(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as their 16 bits; a NaN
    keeps its sign and the upper bits of its payload, made quiet."""
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on NaNs, and makes them canonical
        bits = values.astype(ml_dtypes.bfloat16).view("<u2")
    nan = np.isnan(values)
    if nan.any():
        bits[nan] = ((values[nan].view("<u4") >> 16) | 0x40).astype("<u2")
    return bits


def as_dtype(vector: Rows, dtype: str) -> Rows:
    """Little-endian float32 bytes as little-endian ``dtype`` bytes (rounded to nearest even)."""
    if dtype == "float32":
        return vector
    values = np.frombuffer(vector, dtype="<f4")
    if dtype == "float16":
        return values.astype("<f2").data.cast("B")
    return bfloat16_bits(values).data.cast("B")
