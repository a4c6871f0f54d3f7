"""Every other path: passed through to vLLM as it is, the answer streamed back untouched."""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.types import Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import header_value, send_error
from vllm_hidden_state_proxy.proxy.endpoints import Endpoint
from vllm_hidden_state_proxy.proxy.inspection import check_other_endpoint
from vllm_hidden_state_proxy.proxy.relay import pass_through


class PassthroughApp(Endpoint):
    """Pass through to ``upstream_url + path + query`` and stream the response back untouched,
    unless the body could carry a reserved entry (400)."""

    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        return self._checked(scope, send, body)

    async def _checked(self, scope: Scope, send: Send, body: bytes) -> None:
        error = await check_other_endpoint(body, header_value(scope, b"content-type"))
        if error is not None:
            await send_error(send, error)
            return
        self.state.metrics.requests["ordinary"] += 1
        await pass_through(self.state, scope, send, body)
