"""The catch-all ASGI endpoint: every request the proxy does not handle specially."""

from __future__ import annotations

from vllm_hidden_state_proxy.proxy.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, send_error
from vllm_hidden_state_proxy.proxy.flag import check_reserved_key
from vllm_hidden_state_proxy.proxy.forward import forward
from vllm_hidden_state_proxy.proxy.state import ProxyState


async def receive_body(
    state: ProxyState, scope: Scope, receive: Receive, send: Send
) -> bytes | None:
    """The request body, or ``None`` if the request is already answered (413) or abandoned."""
    limit = state.settings.max_body_bytes
    try:
        return await read_body(scope, receive, limit)
    except BodyTooLarge:
        await send_error(
            send, ProxyError(413, f"Request body exceeds the proxy's limit of {limit} bytes.")
        )
    except ClientDisconnected:
        pass
    return None


class PassthroughApp:
    """Forward to ``upstream_url + path + query`` and stream the response back untouched."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        body = await receive_body(state, scope, receive, send)
        if body is None:
            return
        error = check_reserved_key(body)
        if error is not None:
            await send_error(send, error)
            return
        state.metrics.requests["ordinary"] += 1
        await run_until_disconnect(receive, lambda: forward(state, scope, send, body))
