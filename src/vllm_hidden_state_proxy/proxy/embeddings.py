"""``POST /v1/embeddings`` served from the chat model's last hidden state (OpenAI shape).

The inputs fan out as flagged one-token requests (``embeddings_request`` plans them), at most
``settings.fan_out_limit`` at a time; the answer lists the vectors in input order with usage
summed. If any input fails, the request fails with that error, naming the input's index.
A client disconnect cancels what is still in flight.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Any

import orjson

from vllm_hidden_state_proxy.proxy.asgi import Receive, Scope, Send, run_until_disconnect
from vllm_hidden_state_proxy.proxy.embeddings_request import (
    EmbeddingsPlan,
    dimensions_error,
    plan_embeddings,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, send_error
from vllm_hidden_state_proxy.proxy.fan_out import answers, at_path, fetch_all, first_failure
from vllm_hidden_state_proxy.proxy.flag import parse_object
from vllm_hidden_state_proxy.proxy.flagged import JsonAnswer, no_ring_error, send_whole
from vllm_hidden_state_proxy.proxy.passthrough import receive_body
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors import VectorRecord


def embedding_of(record: VectorRecord, normalize: bool, encoding_format: str) -> list[float] | str:
    """The record's vector, scaled to unit L2 norm on request, as floats or base64 (LE f32)."""
    if not normalize:
        if encoding_format == "base64":
            return base64.b64encode(record.vector).decode("ascii")
        return record.as_floats()
    values = record.as_floats()
    norm = math.hypot(*values)
    if norm > 0:
        scale = 1.0 / norm
        values = [v * scale for v in values]
    if encoding_format != "base64":
        return values
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def input_error(index: int, field: str, failure: JsonAnswer | ProxyError) -> ProxyError:
    """The failure of one input, as the request's error, naming the input."""
    where = f"{field}[{index}]" if field == "input" else field
    if isinstance(failure, ProxyError):
        return ProxyError(failure.status, f"{where}: {failure.message}", failure.param or field)
    message = failure.content.decode("utf-8", "replace")
    try:
        error = orjson.loads(failure.content).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return ProxyError(failure.status, f"{where}: {message}", field)


def embeddings_response(plan: EmbeddingsPlan, complete: list[JsonAnswer]) -> dict[str, Any]:
    data = []
    prompt_tokens = 0
    for index, answer in enumerate(complete):
        assert answer.record is not None
        embedding = embedding_of(answer.record, plan.normalize, plan.encoding_format)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
        prompt_tokens += answer.record.num_prompt_tokens
    model = complete[0].completion.get("model") if complete[0].completion else None
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


class EmbeddingsApp:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        body = await receive_body(state, scope, receive, send)
        if body is None:
            return
        try:
            settings = state.settings
            plan = plan_embeddings(
                parse_object(body), settings.embedding_template, settings.max_embedding_inputs
            )
            if not state.ring.has_ring():
                raise no_ring_error(settings.ring_dir)
            dimensions, hidden_size = plan.dimensions, state.ring.hidden_size()
            if dimensions is not None and hidden_size is not None and dimensions != hidden_size:
                raise dimensions_error(dimensions, hidden_size)
        except ProxyError as error:
            await send_error(send, error)
            return
        state.metrics.requests["embeddings"] += 1
        await run_until_disconnect(receive, lambda: self._answer(scope, send, plan))

    async def _answer(self, scope: Scope, send: Send, plan: EmbeddingsPlan) -> None:
        jobs = [(at_path(scope, path), document) for path, document in plan.calls]
        results = await fetch_all(self.state, jobs)
        failure = first_failure(results)
        if failure is not None:
            await send_error(send, input_error(failure[0], plan.field, failure[1]))
            return
        complete = answers(results)
        payload = orjson.dumps(embeddings_response(plan, complete))
        await send_whole(send, 200, complete[0].headers, payload, b"application/json")
