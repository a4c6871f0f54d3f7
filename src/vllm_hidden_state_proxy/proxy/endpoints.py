"""The base classes of the POST endpoints: what every endpoint app does before and around its
own answer.

:class:`Endpoint`: read the body (413; 503 over the process's budget of buffered bodies; 408
too slow), build the exchange that answers it or refuse it with the proxy's own error (400,
503), then run the exchange until it ends or the client leaves. :class:`GenerationEndpoint`
(chat, completions, responses): also the split into ordinary and flagged, and resolving what a
flagged request asks for against the live rings."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable

from starlette.types import Receive, Scope, Send

from vllm_hidden_state_proxy.protocol import ANSWER_POOLINGS
from vllm_hidden_state_proxy.proxy.answer_choices import check_answerable
from vllm_hidden_state_proxy.proxy.asgi import receive_body, run_until_disconnect, send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import Flagged, Ordinary, inspect_body
from vllm_hidden_state_proxy.proxy.planned_fields import PlannedFields
from vllm_hidden_state_proxy.proxy.relay import pass_through
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vector_lookup import (
    WantedVectors,
    check_matrix_room,
    check_rings,
    resolve_layers,
)
from vllm_hidden_state_proxy.proxy.vector_memory import sharing


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
        # so do its vectors' (taken as they are read, see vector_memory.py).
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
