"""The endpoint apps, one per route (``app.py`` routes them): their base classes here, with the
three whose own part is a few lines; the others in a module each.

:class:`Endpoint`: read the body (413; 503 over the process's budget of buffered bodies; 408
too slow), build the exchange that answers it or refuse it with the proxy's own error (400,
503), then run the exchange until it ends or the client leaves. :class:`GenerationEndpoint`
(chat, completions, responses): also the split into ordinary and flagged, and resolving what a
flagged request asks for against the live rings.

- ``POST /v1/chat/completions``: :class:`ChatApp`; ``POST /v1/responses``:
  :class:`ResponsesApp`; every other path: :class:`PassthroughApp` (here);
- ``POST /v1/completions``: :mod:`.completions` (a flagged list of prompts: one request, or
  a fan-out); ``POST /v1/chat/completions/batch``: :mod:`.chat_batch`;
- ``POST /v1/embeddings``: :mod:`.embeddings`, planned by :mod:`.embeddings_plan`;
- ``GET /health`` and ``GET /metrics``: :mod:`.ops`; ``GET /v1/hidden_states``:
  :mod:`.capture`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable

from starlette.types import Receive, Scope, Send

from vllm_hidden_state_proxy.protocol import ANSWER_POOLINGS, KV, POOLING
from vllm_hidden_state_proxy.proxy.asgi import (
    header_value,
    receive_body,
    run_until_disconnect,
    send_error,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request
from vllm_hidden_state_proxy.proxy.inspection import (
    Flagged,
    Ordinary,
    check_other_endpoint,
    inspect_body,
)
from vllm_hidden_state_proxy.proxy.keyed_exchange import keyed_exchange
from vllm_hidden_state_proxy.proxy.planned_fields import (
    CHAT_FIELDS,
    RESPONSES_FIELDS,
    PlannedFields,
)
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.streams.relay import pass_through
from vllm_hidden_state_proxy.proxy.streams.responses import relay_responses_with_vectors
from vllm_hidden_state_proxy.proxy.vectors.answers import check_answerable
from vllm_hidden_state_proxy.proxy.vectors.memory import sharing
from vllm_hidden_state_proxy.proxy.vectors.plan import (
    check_matrix_room,
    check_rings,
    resolve_layers,
)
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors


class Endpoint(ABC):
    """One POST endpoint: :meth:`exchange` says how a request body is answered."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    @abstractmethod
    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        """The exchange that answers ``body``, not yet started; ``ProxyError`` to refuse it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.state.settings
        # The body's bytes count against the budget until the exchange that holds them ends;
        # so do its vectors' (taken as they are read, see vectors/memory.py).
        vectors = sharing(self.state.vector_memory, scope, settings.send_timeout)
        with self.state.body_budget.share() as share, vectors:
            body = await receive_body(
                scope, receive, send, settings.max_body_bytes, share, settings.body_timeout
            )
            if body is None:  # answered (413, 503, 408) or abandoned
                return
            try:
                exchange = self.exchange(scope, send, body)
            except ProxyError as error:
                await send_error(send, error)
                return
            await run_until_disconnect(receive, exchange)


class GenerationEndpoint(Endpoint):
    """Chat, completions and responses: an ordinary request passes through byte for byte, a
    flagged one is answered by :meth:`flagged_exchange`."""

    #: The endpoint's fields the proxy plans a flagged request with (read as vLLM reads them).
    planned_fields: PlannedFields

    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        decision = inspect_body(body, self.planned_fields)
        if isinstance(decision, Ordinary):
            self.state.metrics.requests["ordinary"] += 1
            return pass_through(self.state, scope, send, decision.body)
        self.state.metrics.flagged_received += 1
        return self.flagged_exchange(scope, send, decision)

    @abstractmethod
    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        """The exchange that answers ``flagged``, not yet started; ``ProxyError`` to refuse it."""


def resolve_wanted(state: ProxyState, flagged: Flagged) -> WantedVectors:
    """What ``flagged`` asks for, in absolute layers of the live rings; ``ProxyError`` (503 no
    ring, 400 a layer not captured) otherwise."""
    if flagged.vectors.pooling in ANSWER_POOLINGS:
        check_answerable(flagged.document)
    shapes = check_rings(state.rings, state.settings.ring_dir)
    wanted = resolve_layers(flagged.vectors, shapes)
    check_matrix_room(flagged.document, wanted, shapes)
    state.metrics.requests["flagged"] += 1
    return wanted


class ChatApp(GenerationEndpoint):
    """``POST /v1/chat/completions``: ordinary requests pass through, flagged ones get vectors."""

    planned_fields = CHAT_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        wanted = resolve_wanted(self.state, flagged)
        return keyed_exchange(self.state, scope, send, flagged.document, wanted)


class ResponsesApp(GenerationEndpoint):
    """``POST /v1/responses``: like chat; a flagged stream gets its vectors on
    ``response.completed``.

    vLLM's ``ResponsesRequest`` takes ``vllm_xargs`` and ``kv_transfer_params`` as chat does,
    and its response object carries ``kv_transfer_params``: a flagged JSON reply gets the
    vectors there, a flagged stream in the final response of its ``response.completed`` event
    (:mod:`..streams.responses`). The prompt is what vLLM builds from ``instructions`` (a
    system message), ``input`` (a string is one user message) and, with
    ``previous_response_id``, the stored conversation before it.
    """

    planned_fields = RESPONSES_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        if flagged.vectors.pooling in ANSWER_POOLINGS:
            raise bad_request(
                f"'{KV}.{POOLING}': {flagged.vectors.pooling!r} is not supported on "
                "/v1/responses yet: use /v1/chat/completions or /v1/completions for the "
                "answer's hidden state.",
                f"{KV}.{POOLING}",
            )
        wanted = resolve_wanted(self.state, flagged)
        return keyed_exchange(
            self.state,
            scope,
            send,
            flagged.document,
            wanted,
            relay_stream=relay_responses_with_vectors,
        )


class PassthroughApp(Endpoint):
    """Every other path: passed through to ``upstream_url + path + query`` and the reply
    streamed back untouched, unless the body could carry a reserved entry (400)."""

    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        return self._checked(scope, send, body)

    async def _checked(self, scope: Scope, send: Send, body: bytes) -> None:
        error = await check_other_endpoint(body, header_value(scope, b"content-type"))
        if error is not None:
            await send_error(send, error)
            return
        self.state.metrics.requests["ordinary"] += 1
        await pass_through(self.state, scope, send, body)
