"""A flagged request against the rings, before it is sent: whether they can serve it
(:func:`check_rings`), in which absolute layers (:func:`resolve_layers`, giving
``wanted_vectors.WantedVectors``), and whether its matrices can fit (:func:`check_matrix_room`).
Each refusal is the proxy's own error, before vLLM does any work; once vLLM has replied, the record
is looked up by :mod:`.lookup`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import vllm_hidden_state_proxy.proxy.vectors.memory as vector_memory
from vllm_hidden_state_proxy.protocol import (
    KV,
    LAYERS,
    MATRIX_POOLINGS,
)
from vllm_hidden_state_proxy.proxy.errors import (
    all_answer_too_large,
    bad_request,
    engines_without_ring,
    no_arena,
    no_ring,
    ring_directory_refused,
    rings_of_other_models,
)
from vllm_hidden_state_proxy.proxy.state import RingSource
from vllm_hidden_state_proxy.request_fields import (
    RequestFieldError,
    VectorRequest,
    is_int,
    is_token_ids,
)
from vllm_hidden_state_proxy.ring import (
    RingShape,
)
from vllm_hidden_state_proxy.ring.layout import arena_block_size
from vllm_hidden_state_proxy.ring.records import matrix_bytes
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors
from vllm_hidden_state_proxy.wanted_vectors import resolve_layers as layers_of


def check_rings(rings: RingSource, ring_dir: str) -> tuple[RingShape, ...]:
    """The live rings' shapes, before a flagged request is sent; 503 if there are none (naming
    why the directory is refused, if it is), or if they are of different models (servers of two
    models sharing the directory: the worker hook refuses the second, unless both started before
    either saw the other's ring)."""
    shapes = rings.live_shapes() if rings.has_ring() else ()
    if not shapes:
        refusal = rings.refusal()
        if refusal is not None:  # nothing in it is read: its notes could be anyone's
            raise ring_directory_refused(refusal)
        failures = rings.failed_engines()
        raise engines_without_ring(failures) if failures else no_ring(ring_dir)
    if any(shape.model_dims != shapes[0].model_dims for shape in shapes[1:]):
        raise rings_of_other_models(shapes, ring_dir)
    return shapes


def resolve_layers(
    request: VectorRequest, shapes: Sequence[RingShape], param: str = f"{KV}.{LAYERS}"
) -> WantedVectors:
    """Absolute layer indices for ``request`` on rings of ``shapes`` (at least one): the layers
    every ring captures (:func:`~vllm_hidden_state_proxy.wanted_vectors.resolve_layers`).

    Raises 400 listing the captured layers for a layer the server does not capture.
    """
    captured = set(shapes[0].layers)
    for other in shapes[1:]:
        captured &= set(other.layers)
    try:
        return layers_of(request, shapes[0].num_hidden_layers, captured, param)
    except RequestFieldError as refused:
        raise bad_request(refused.message, refused.param) from None


def check_matrix_room(
    document: dict[str, Any], wanted: WantedVectors, shapes: Sequence[RingShape]
) -> None:
    """Before a matrix pooling is sent: 503 if the server carries no matrices; for
    ``"all_answer"`` with ``max_tokens`` (or ``max_completion_tokens``), 413 if that many rows
    would be more than one request may take. (Without it, the hook decides with vLLM's own
    default, and an ``"all_prompt"`` prompt's length is known only in vLLM.)"""
    pooling = wanted.request.record_pooling
    if pooling not in MATRIX_POOLINGS:
        return
    if any(shape.arena_size == 0 for shape in shapes):
        raise no_arena(pooling)
    _check_vectors_bound(document, wanted, shapes)
    if wanted.request.pooling != "all_answer":
        return
    limits = [document.get(name) for name in ("max_completion_tokens", "max_tokens")]
    rows = next((value for value in limits if is_int(value)), None)
    if rows is None:
        return
    limit = min(shape.max_record for shape in shapes)
    size = matrix_bytes(rows, len(wanted.distinct_layers), shapes[0].hidden_size)
    if arena_block_size(size) > limit:  # the hook's max record counts the block's header
        param = "max_completion_tokens" if is_int(limits[0]) else "max_tokens"
        layers, hidden_size = len(wanted.distinct_layers), shapes[0].hidden_size
        raise all_answer_too_large(rows, layers, hidden_size, size, limit, param)


def _check_vectors_bound(
    document: dict[str, Any], wanted: WantedVectors, shapes: Sequence[RingShape]
) -> None:
    """413 before sending if the request's matrices, as far as their size is known now, are
    more than ``--max-vectors-size``: ``"all_answer"`` with ``max_tokens`` (times ``n``), and
    ``"all_prompt"`` of token-id prompts; either times the prompts of a completions list (the
    conversations of a chat batch). (The
    rows of a text prompt are known only in vLLM: those are counted as they arrive.)"""
    share = vector_memory.current()
    if share is None:
        return
    pooling = wanted.request.pooling
    prompt = document.get("prompt")
    prompts: list[Any] = [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = prompt
    messages = document.get("messages")  # a chat batch's conversations
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        prompts = messages
    if pooling == "all_answer":
        limits = [document.get(name) for name in ("max_completion_tokens", "max_tokens")]
        rows = next((value for value in limits if is_int(value)), None)
        n = document.get("n")
        choices = n if is_int(n) and n > 0 else 1
        if rows is None:
            return
        total_rows = rows * choices * len(prompts)
        param = "max_completion_tokens" if is_int(limits[0]) else "max_tokens"
    elif pooling == "all_prompt" and all(is_token_ids(ids) for ids in prompts):
        total_rows = sum(len(ids) for ids in prompts)
        param = "prompt"
    else:
        return
    size = matrix_bytes(total_rows, len(wanted.distinct_layers), shapes[0].hidden_size)
    if size > share.memory.per_request:
        raise share.refuse(size, param)
