"""Every other path: forwarded to vLLM as it is, the answer streamed back untouched."""

from __future__ import annotations

from vllm_hidden_state_proxy.proxy.asgi import (
    Receive,
    Scope,
    Send,
    receive_body,
    run_until_disconnect,
    send_error,
)
from vllm_hidden_state_proxy.proxy.inspection import check_other_endpoint
from vllm_hidden_state_proxy.proxy.relay import forward
from vllm_hidden_state_proxy.proxy.state import ProxyState


class PassthroughApp:
    """Forward to ``upstream_url + path + query`` and stream the response back untouched."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        body = await receive_body(scope, receive, send, state.settings.max_body_bytes)
        if body is None:
            return
        error = check_other_endpoint(body)
        if error is not None:
            await send_error(send, error)
            return
        state.metrics.requests["ordinary"] += 1
        await run_until_disconnect(receive, forward(state, scope, send, body))
