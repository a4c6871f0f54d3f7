"""The ``kv_transfer_params`` fields a flagged response carries, built from ring records.

- ``last_hidden_state``: the vector; a JSON list of floats (format ``"float"``) or base64 of
  little-endian float32 (format ``"base64"``, like OpenAI embeddings' ``encoding_format``; the
  ring already stores that byte layout, so no float list is built on this path).
- ``last_hidden_state_info`` (on request): where and what the vector is.
- Requests with several prompts (``/v1/completions`` with a list) get the plural names,
  ``last_hidden_states`` and ``last_hidden_state_infos``, one entry per prompt in prompt order.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from vllm_hidden_state_proxy.proxy.flag import VectorOptions
from vllm_hidden_state_proxy.proxy.vectors import VectorRecord

VECTOR = "last_hidden_state"
VECTORS = "last_hidden_states"
INFO = "last_hidden_state_info"
INFOS = "last_hidden_state_infos"


def encode_vector(record: VectorRecord, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(record.vector).decode("ascii")
    return record.as_floats()


def vector_info(record: VectorRecord) -> dict[str, Any]:
    return {
        "position": record.position,
        "num_prompt_tokens": record.num_prompt_tokens,
        "hidden_size": record.hidden_size,
        "dtype": "float32",
        "layer": "final_norm",
    }


def single_prompt_fields(record: VectorRecord, options: VectorOptions) -> dict[str, Any]:
    fields: dict[str, Any] = {VECTOR: encode_vector(record, options.format)}
    if options.info:
        fields[INFO] = vector_info(record)
    return fields


def prompt_list_fields(records: Sequence[VectorRecord], options: VectorOptions) -> dict[str, Any]:
    fields: dict[str, Any] = {VECTORS: [encode_vector(r, options.format) for r in records]}
    if options.info:
        fields[INFOS] = [vector_info(r) for r in records]
    return fields
