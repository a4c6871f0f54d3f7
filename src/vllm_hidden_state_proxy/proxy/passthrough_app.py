"""Every other path: forwarded to vLLM as it is, the answer streamed back untouched."""

from __future__ import annotations

from collections.abc import Awaitable

from vllm_hidden_state_proxy.proxy.admission import Endpoint
from vllm_hidden_state_proxy.proxy.asgi import Scope, Send
from vllm_hidden_state_proxy.proxy.inspection import check_other_endpoint
from vllm_hidden_state_proxy.proxy.relay import forward


class PassthroughApp(Endpoint):
    """Forward to ``upstream_url + path + query`` and stream the response back untouched."""

    def exchange(self, scope: Scope, send: Send, body: bytes) -> Awaitable[None]:
        error = check_other_endpoint(body)
        if error is not None:
            raise error
        self.state.metrics.requests["ordinary"] += 1
        return forward(self.state, scope, send, body)
