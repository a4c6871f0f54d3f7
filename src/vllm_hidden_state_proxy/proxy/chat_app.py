"""``POST /v1/chat/completions``: ordinary requests pass through, flagged ones get vectors."""

from __future__ import annotations

from collections.abc import Awaitable

from vllm_hidden_state_proxy.proxy.admission import GenerationEndpoint, resolve_wanted
from vllm_hidden_state_proxy.proxy.asgi import Scope, Send
from vllm_hidden_state_proxy.proxy.flagged_exchange import flagged_exchange
from vllm_hidden_state_proxy.proxy.inspection import Flagged


class ChatApp(GenerationEndpoint):
    def flagged(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        wanted = resolve_wanted(self.state, flagged)
        return flagged_exchange(self.state, scope, send, flagged.document, wanted)
