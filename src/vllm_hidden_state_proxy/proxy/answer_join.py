"""Joining records into vLLM's answer: the ``kv_transfer_params`` fields, and whole responses.

Fields of the answer to a flagged request (in ``kv_transfer_params``; others that vLLM returns
there are kept):

- ``last_hidden_state``: the final layer's vector, whenever the final layer was asked for or
  no layers were given; a JSON list of floats (format ``"float"``: each float32 written as the
  shortest decimal that reads back as the same float32, by orjson straight from the ring's
  bytes viewed as a numpy array) or base64 of little-endian float32 (``"base64"``, like OpenAI
  embeddings' ``encoding_format``; the ring already stores that byte layout).
- ``last_hidden_states_by_layer``: with ``last_hidden_state_layers``, each requested layer,
  written as in the request (``"4"``, ``"-1"``), to its vector.
- ``last_hidden_state_info`` (on request): where and what the vectors are.
- A matrix pooling (``"all_prompt"``, ``"all_answer"``) puts, where a vector would be, an object
  ``{"shape": [rows, hidden_size], "dtype", "data"}``: ``data`` base64 of the little-endian
  rows one after another (the default for matrices), or a list of rows (``"float"``).
- ``last_hidden_state_dtype`` ``"float16"``/``"bfloat16"`` rounds base64 values to 16 bits
  (to nearest, ties to even; bfloat16 is float32's upper half, by ``ml_dtypes``, a NaN kept
  with its payload's upper bits and made quiet), and the answer repeats the field beside them:
  a bare base64 string does not say its dtype, and read as float32 a 16-bit vector would be
  half as long and wrong without any error.
- A matrix rides in the fields as a :class:`Matrix`, not yet encoded: :func:`dump_json`
  encodes it in place; :mod:`.answer_body` sends a large one in pieces, encoded off the loop.
- A request with several prompts (``/v1/completions`` with a list) gets the same fields in the
  plural (``last_hidden_states``, ``last_hidden_state_infos``) or, for layers, a list of
  objects: one entry per prompt, in prompt order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pybase64

from vllm_hidden_state_proxy.protocol import MATRIX_POOLINGS
from vllm_hidden_state_proxy.proxy.asgi import send_response
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.types import (
    BY_LAYER,
    DTYPE,
    INFO,
    INFOS,
    KV,
    VECTOR,
    VECTORS,
    RawHeaders,
    Send,
    WantedVectors,
)
from vllm_hidden_state_proxy.ring import Record
from vllm_hidden_state_proxy.ring.records import Rows
from vllm_hidden_state_proxy.wanted_vectors import as_dtype as as_dtype
from vllm_hidden_state_proxy.wanted_vectors import bfloat16_bits as bfloat16_bits
from vllm_hidden_state_proxy.wanted_vectors import vector_info as vector_info

#: Upstream headers not copied onto a rebuilt JSON response (the proxy sets its own).
REBUILT_DROP = frozenset({b"content-length", b"content-type", b"content-encoding"})


#: A vector as float32 values in native byte order, which :func:`dump_json` writes as a list.
Floats = npt.NDArray[np.float32]


def float32_view(vector: Rows) -> Floats:
    """Little-endian float32 bytes as a float32 array (a view, no copy, on little-endian hosts)."""
    return np.frombuffer(vector, dtype="<f4").astype(np.float32, copy=False)


def base64_text(vector: Rows) -> str:
    return pybase64.b64encode(vector).decode("ascii")


def encode_vector(vector: Rows, fmt: str, dtype: str = "float32") -> Floats | str:
    if fmt == "base64":
        return base64_text(as_dtype(vector, dtype))
    return float32_view(vector)


class Matrix:
    """A matrix's rows (little-endian float32) and how the client asked for them: the
    ``"data"`` of its JSON object, not yet encoded. (Not a dataclass: orjson would write one
    as an object instead of asking :func:`_encoded`.)"""

    __slots__ = ("count", "dtype", "fmt", "hidden_size", "rows")

    def __init__(self, rows: Rows, count: int, hidden_size: int, fmt: str, dtype: str) -> None:
        self.rows = rows
        self.count = count
        self.hidden_size = hidden_size
        self.fmt = fmt
        self.dtype = dtype

    @property
    def size(self) -> int:
        return len(self.rows) if isinstance(self.rows, (bytes, bytearray)) else self.rows.nbytes

    def encoded(self) -> Floats | str:
        """The whole ``"data"`` value, for :func:`dump_json`."""
        data = encode_vector(self.rows, self.fmt, self.dtype)
        return data if isinstance(data, str) else data.reshape(self.count, self.hidden_size)


def encode_matrix(
    rows: Rows, count: int, hidden_size: int, fmt: str, dtype: str = "float32"
) -> dict[str, Any]:
    """A matrix of ``count`` rows (little-endian float32 bytes) as its JSON object; its
    ``"data"`` a :class:`Matrix`, encoded where the answer is written."""
    return {
        "shape": [count, hidden_size],
        "dtype": dtype if fmt == "base64" else "float32",
        "data": Matrix(rows, count, hidden_size, fmt, dtype),
    }


def _encoded(value: Any) -> Any:
    if isinstance(value, Matrix):
        return value.encoded()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def dump_json(document: Any) -> bytes:
    """``document`` as JSON, its :data:`Floats` as lists of float32's shortest decimals.

    Shorter than the float64 decimals of the same values (~45% fewer bytes) and faster to
    write; a reader that parses them as float32 gets the ring's values bit for bit.
    Raises ``orjson.JSONEncodeError`` (e.g. nested deeper than orjson writes).
    """
    return orjson.dumps(document, default=_encoded, option=orjson.OPT_SERIALIZE_NUMPY)


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
    answer stays as it always was."""
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


async def send_whole(
    send: Send, status: int, upstream_headers: RawHeaders, body: bytes, content_type: bytes
) -> None:
    """A complete response with vLLM's headers (minus hop-by-hop and the ones rebuilt here)."""
    headers = downstream_response_headers(upstream_headers, drop=REBUILT_DROP)
    await send_response(send, status, body, content_type, headers)


async def send_unchanged(send: Send, status: int, headers: RawHeaders, content: bytes) -> None:
    """A complete answer as vLLM wrote it (status, content type, body)."""
    content_type = b"application/json"
    for name, value in headers:
        if name.lower() == b"content-type":
            content_type = value
            break
    await send_whole(send, status, headers, content, content_type)
