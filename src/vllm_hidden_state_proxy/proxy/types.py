"""What the proxy's modules share: its words, the client's field names, what a flagged request
asks for, the ASGI aliases, and what the proxy needs of the rings. (No behaviour but a few type
checks of JSON values; the project-wide words are in ``protocol.py``.)

Words (one per concept, in code, docs and messages):

- **flagged request**: a client's request whose ``kv_transfer_params`` carries
  ``return_last_hidden_state: true`` (the **flag**), asking for vectors. Any other request is
  **ordinary**. Inspection tells the two apart (``inspection.py``: ``Ordinary | Flagged``).
- **vector request** (:class:`VectorRequest`): what a flagged request asks for, as the client
  wrote it; **wanted vectors** (:class:`WantedVectors`): the same in absolute layers of the
  live rings.
- **keyed request**: a request the proxy sends vLLM for a flagged request, with a fresh
  request key in ``vllm_xargs``. A flagged request is sent as one keyed request, or as several
  (a list of prompts, embeddings inputs: the **fan-out**, ``fan_out.py``).
- **exchange**: everything that answers one client request once its body is read, from the
  request to vLLM to the client's last byte; an endpoint builds it (``endpoints.py``), a client
  that leaves cancels it.
- **pass through**: send a request to vLLM as the client sent it and relay the answer back
  untouched (ordinary requests, every other path).
- **relay**: copy vLLM's answer to the client as it arrives.
- **answer**: vLLM's response to a request; **join**: put the vectors into an answer
  (``answer_join.py``, and for streams ``stream_rewrite.py``, ``responses_stream.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from vllm_hidden_state_proxy.protocol import (
    BY_LAYER,
    DTYPE,
    DTYPES,
    FLAG,
    FORMAT,
    FORMATS,
    INFO,
    INFOS,
    KV,
    LAYERS,
    OWN_FIELDS,
    POOLING,
    SPANS,
    VECTOR,
    VECTORS,
    XARGS,
)
from vllm_hidden_state_proxy.request_fields import VectorRequest, is_int
from vllm_hidden_state_proxy.ring import (
    EngineFailure,
    Found,
    PendingRows,
    PublishMarks,
    RingHeader,
    RingShape,
)
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

# -- the client's field names: ``protocol.py`` (the client module reads them too); what a
# flagged request asks for: ``request_fields.py`` and ``wanted_vectors.py`` (shared with the
# offline API) -------------------------------------------------------------------------------

__all__ = [
    "BY_LAYER",
    "DTYPE",
    "DTYPES",
    "FLAG",
    "FORMAT",
    "FORMATS",
    "INFO",
    "INFOS",
    "KV",
    "LAYERS",
    "OWN_FIELDS",
    "POOLING",
    "SPANS",
    "VECTOR",
    "VECTORS",
    "XARGS",
    "VectorRequest",
    "WantedVectors",
    "is_int",
]


def is_token_ids(value: Any) -> bool:
    """A non-empty list of token ids (JSON integers). (The set of the items' types is built in
    C: a 5th of the time of a generator over thousands of ids.)"""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


# -- ASGI ------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# -- the rings -------------------------------------------------------------------------------


class RingSource(Protocol):
    """What the proxy needs from ``ring.RingDirectory`` (tests may pass a fake)."""

    def lookup(self, key: bytes) -> Found | None: ...

    def find(self, key: bytes) -> Found | PendingRows | None: ...

    def has_ring(self) -> bool: ...

    def live_ring_count(self) -> int: ...

    def live_shapes(self) -> tuple[RingShape, ...]: ...

    def live_headers(self) -> tuple[RingHeader, ...]: ...

    def failed_engines(self) -> tuple[EngineFailure, ...]: ...

    def refusal(self) -> str | None: ...

    def publishing_instances(self) -> frozenset[int]: ...

    def publish_marks(self) -> PublishMarks: ...

    def overwritten_since(self, marks: PublishMarks) -> bool: ...

    def smallest_slot_count(self) -> int | None: ...

    def close(self) -> None: ...
