"""``POST /v1/embeddings`` served from the chat model's hidden states (OpenAI shape).

The inputs fan out as keyed one-token requests (:mod:`.embeddings_plan` plans them), at most
``settings.fan_out_limit`` at a time; the response lists the vectors in input order with usage
summed. If any input fails, the request fails with that error, naming the input's index.
A client disconnect cancels what is still in flight.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import numpy as np
import orjson
from starlette.types import Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.endpoints import Endpoint
from vllm_hidden_state_proxy.proxy.endpoints.embeddings_plan import (
    FORWARDED_FIELDS,
    EmbeddingsDefaults,
    EmbeddingsPlan,
    dimensions_error,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    default_layer_not_captured,
    embedding_not_finite,
    of_input,
)
from vllm_hidden_state_proxy.proxy.fan_out import Failed, at_path, fetch_all
from vllm_hidden_state_proxy.proxy.inspection import parse_object
from vllm_hidden_state_proxy.proxy.keyed_request import JoinableReply, UnchangedReply
from vllm_hidden_state_proxy.proxy.replies import encoded_off_loop, send_counted_whole
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.encoding import (
    Floats,
    base64_text,
    dump_json,
    float32_view,
)
from vllm_hidden_state_proxy.proxy.vectors.plan import check_rings, resolve_layers
from vllm_hidden_state_proxy.ring.records import Rows
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors


def embedding_of(vector: Rows, normalize: bool, encoding_format: str) -> Floats | str:
    """A vector (LE float32 bytes), scaled to unit L2 norm on request (in float64, then rounded
    to float32), as float32 values or base64 of their little-endian bytes."""
    if not normalize:
        if encoding_format == "base64":
            return base64_text(vector)
        return float32_view(vector)
    values = float32_view(vector).astype(np.float64)
    norm = float(np.linalg.norm(values))
    scaled = (values / norm if norm > 0 else values).astype(np.float32)
    if encoding_format != "base64":
        return scaled
    return base64_text(scaled.astype("<f4").data)


def _where(index: int, field: str) -> str:
    return f"{field}[{index}]" if field == "input" else field


def input_error(index: int, field: str, failure: UnchangedReply | ProxyError) -> ProxyError:
    """The failure of one input, as the request's error, naming the input. vLLM's own error
    keeps its ``type``, and its ``param`` where that is a field the client sent (a wrong
    ``model`` names ``model``; a prompt too long names the input)."""
    where = _where(index, field)
    if isinstance(failure, ProxyError):
        return of_input(
            where, failure.status, failure.message, failure.param or field, failure.kind
        )
    message = failure.content.decode("utf-8", "replace")
    param, kind = field, None
    try:
        error = orjson.loads(failure.content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        if isinstance(error.get("message"), str):
            message = error["message"]
        # vLLM's other ``param`` names (``input_tokens`` for a prompt too long...) are fields
        # of the request the proxy built, whose prompt is the client's input.
        if error.get("param") in FORWARDED_FIELDS[field]:
            param = error["param"]
        if isinstance(error.get("type"), str):
            kind = error["type"]
    return of_input(where, failure.status, message, param, kind)


def embeddings_response(
    plan: EmbeddingsPlan, wanted: WantedVectors, replies: list[JoinableReply]
) -> dict[str, Any]:
    layer = wanted.layers[0]
    data = []
    prompt_tokens = 0
    for index, reply in enumerate(replies):
        vector = reply.record.vector(layer)
        if not np.isfinite(float32_view(vector)).all():
            raise embedding_not_finite(_where(index, plan.field), plan.field)
        embedding = embedding_of(vector, plan.normalize, plan.encoding_format)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
        prompt_tokens += reply.record.num_prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": replies[0].completion.get("model"),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


class EmbeddingsApp(Endpoint):
    def __init__(self, state: ProxyState) -> None:
        super().__init__(state)
        settings = state.settings
        self.defaults = EmbeddingsDefaults(
            template=settings.embedding_template,
            max_inputs=settings.max_embedding_inputs,
            layer=settings.embedding_layer,
            pooling=settings.embedding_pooling,
        )

    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        state = self.state
        plan = plan_embeddings(parse_object(body), self.defaults)
        shapes = check_rings(state.rings, state.settings.ring_dir)
        try:
            wanted = resolve_layers(plan.vectors, shapes, param="layer")
        except ProxyError as error:
            if plan.layer_given:
                raise
            raise default_layer_not_captured(error) from None
        hidden_size = shapes[0].hidden_size
        if plan.dimensions is not None and plan.dimensions != hidden_size:
            raise dimensions_error(plan.dimensions, hidden_size)
        state.metrics.requests["embeddings"] += 1
        return self._respond(scope, send, plan, wanted)

    async def _respond(
        self, scope: Scope, send: Send, plan: EmbeddingsPlan, wanted: WantedVectors
    ) -> None:
        jobs = [(at_path(scope, path), document) for path, document in plan.calls]
        replies = await fetch_all(self.state, jobs, wanted)
        if isinstance(replies, Failed):
            await send_error(send, input_error(replies.index, plan.field, replies.failure))
            return
        try:
            response = embeddings_response(plan, wanted, replies)
            # Up to --max-embedding-inputs vectors: written in a thread when large, and counted.
            payload = await encoded_off_loop(lambda: dump_json(response), response)
        except ProxyError as error:
            await send_error(send, error)
            return
        # Within --send-timeout and a least rate (replies.py): the vectors stay counted
        # until the client has them.
        await send_counted_whole(send, replies[0].headers, payload, b"application/json")
