"""``POST /v1/chat/completions`` and ``POST /v1/completions``: ordinary requests pass through,
flagged ones get their vector (completions with a list of prompts: one vector per prompt)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from vllm_hidden_state_proxy.proxy.asgi import Receive, Scope, Send, run_until_disconnect
from vllm_hidden_state_proxy.proxy.completions import completions_exchange, prompt_list
from vllm_hidden_state_proxy.proxy.errors import ProxyError, send_error
from vllm_hidden_state_proxy.proxy.flag import Decision, Forward, inspect_body
from vllm_hidden_state_proxy.proxy.flagged import flagged_exchange, no_ring_error
from vllm_hidden_state_proxy.proxy.forward import forward
from vllm_hidden_state_proxy.proxy.passthrough import receive_body
from vllm_hidden_state_proxy.proxy.state import ProxyState


class GenerationApp:
    """The endpoints that accept ``kv_transfer_params.return_last_hidden_state``."""

    def __init__(self, state: ProxyState, *, completions: bool) -> None:
        self.state = state
        self.completions = completions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await receive_body(self.state, scope, receive, send)
        if body is None:
            return
        try:
            exchange = self._exchange(scope, send, inspect_body(body))
        except ProxyError as error:
            await send_error(send, error)
            return
        await run_until_disconnect(receive, exchange)

    def _exchange(
        self, scope: Scope, send: Send, decision: Decision
    ) -> Callable[[], Awaitable[None]]:
        """What to run for the request; raises ``ProxyError`` for a flagged one it refuses."""
        state = self.state
        if isinstance(decision, Forward):
            state.metrics.requests["ordinary"] += 1
            forwarded = decision.body
            return lambda: forward(state, scope, send, forwarded)
        state.metrics.flagged_received += 1
        document, options = decision.document, decision.options
        prompts = prompt_list(document) if self.completions else None
        if not state.ring.has_ring():
            raise no_ring_error(state.settings.ring_dir)
        state.metrics.requests["flagged"] += 1
        if prompts is None:
            return lambda: flagged_exchange(state, scope, send, document, options)
        return lambda: completions_exchange(state, scope, send, document, options, prompts)
