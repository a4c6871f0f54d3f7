"""``POST /v1/chat/completions``: ordinary requests pass through, flagged ones get vectors."""

from __future__ import annotations

from vllm_hidden_state_proxy.proxy.admission import read_decision, resolve_wanted
from vllm_hidden_state_proxy.proxy.asgi import (
    Receive,
    Scope,
    Send,
    run_until_disconnect,
    send_error,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.flagged_exchange import flagged_exchange
from vllm_hidden_state_proxy.proxy.inspection import Ordinary
from vllm_hidden_state_proxy.proxy.relay import forward
from vllm_hidden_state_proxy.proxy.state import ProxyState


class ChatApp:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        decision = await read_decision(state, scope, receive, send)
        if decision is None:
            return
        if isinstance(decision, Ordinary):
            await run_until_disconnect(receive, forward(state, scope, send, decision.body))
            return
        try:
            wanted = resolve_wanted(state, decision)
        except ProxyError as error:
            await send_error(send, error)
            return
        exchange = flagged_exchange(state, scope, send, decision.document, wanted)
        await run_until_disconnect(receive, exchange)
