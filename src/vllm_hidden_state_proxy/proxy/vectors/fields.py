"""The fields a flagged request's records become in vLLM's reply (in ``kv_transfer_params``;
others that vLLM returns there are kept), built from the records and :class:`WantedVectors`:

- ``last_hidden_state``: the final layer's vector, whenever the final layer was asked for or
  no layers were given (encoded as the request asks, :mod:`.encoding`).
- ``last_hidden_states_by_layer``: with ``last_hidden_state_layers``, each requested layer,
  written as in the request (``"4"``, ``"-1"``), to its vector.
- ``last_hidden_state_info`` (on request): where and what the vectors are.
- A matrix pooling (``"all_prompt"``, ``"all_answer"``) puts, where a vector would be, an object
  ``{"shape": [rows, hidden_size], "dtype", "data"}``.
- ``last_hidden_state_dtype`` beside 16-bit values: a bare base64 string does not say its
  dtype, and read as float32 a 16-bit vector would be half as long and wrong without any error.
- A request with several prompts (``/v1/completions`` with a list) gets the same fields in the
  plural (``last_hidden_states``, ``last_hidden_state_infos``) or, for layers, a list of
  objects: one entry per prompt, in prompt order.

:func:`with_kv_fields` joins them into a document (a JSON reply, a stream's chunk, the
Responses API's final response); :mod:`..replies` sends the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    BY_LAYER,
    DTYPE,
    INFO,
    INFOS,
    KV,
    MATRIX_POOLINGS,
    VECTOR,
    VECTORS,
)
from vllm_hidden_state_proxy.proxy.vectors.encoding import encode_matrix, encode_vector
from vllm_hidden_state_proxy.ring import Record
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, vector_info


def _vector_fields(record: Record, wanted: WantedVectors) -> dict[str, Any]:
    fmt, dtype = wanted.request.format, wanted.request.dtype
    matrix = record.pooling in MATRIX_POOLINGS

    def encoded(layer: int) -> Any:
        if matrix:
            return encode_matrix(record.vector(layer), record.rows, record.hidden_size, fmt, dtype)
        return encode_vector(record.vector(layer), fmt, dtype)

    fields: dict[str, Any] = {}
    if wanted.final_layer in wanted.layers:
        fields[VECTOR] = encoded(wanted.final_layer)
    if wanted.request.layers is not None:
        fields[BY_LAYER] = {
            str(label): encoded(layer)
            for label, layer in zip(wanted.request.layers, wanted.layers, strict=True)
        }
    return fields


def _dtype_field(wanted: WantedVectors) -> dict[str, Any]:
    """``{DTYPE: dtype}`` beside 16-bit values (only base64 has them), else nothing: a float32
    reply stays as it always was."""
    dtype = wanted.request.dtype
    return {} if dtype == "float32" else {DTYPE: dtype}


def single_prompt_fields(record: Record, wanted: WantedVectors) -> dict[str, Any]:
    fields = _vector_fields(record, wanted) | _dtype_field(wanted)
    if wanted.request.info:
        fields[INFO] = vector_info(record, wanted)
    return fields


def prompt_list_fields(records: Sequence[Record], wanted: WantedVectors) -> dict[str, Any]:
    per_prompt = [_vector_fields(record, wanted) for record in records]
    fields: dict[str, Any] = {}
    if wanted.final_layer in wanted.layers:
        fields[VECTORS] = [prompt[VECTOR] for prompt in per_prompt]
    if wanted.request.layers is not None:
        fields[BY_LAYER] = [prompt[BY_LAYER] for prompt in per_prompt]
    fields |= _dtype_field(wanted)
    if wanted.request.info:
        fields[INFOS] = [vector_info(record, wanted) for record in records]
    return fields


def with_kv_fields(document: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``document`` with ``fields`` merged into its ``kv_transfer_params`` (others kept)."""
    kv = document.get(KV)
    merged = dict(kv) if isinstance(kv, dict) else {}
    merged.update(fields)
    return {**document, KV: merged}
