"""``POST /v1/chat/completions``: ordinary requests pass through, flagged ones get vectors."""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.types import Scope, Send

from vllm_hidden_state_proxy.proxy.endpoints import GenerationEndpoint, resolve_wanted
from vllm_hidden_state_proxy.proxy.inspection import Flagged
from vllm_hidden_state_proxy.proxy.keyed_exchange import keyed_exchange
from vllm_hidden_state_proxy.proxy.planned_fields import CHAT_FIELDS


class ChatApp(GenerationEndpoint):
    planned_fields = CHAT_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        wanted = resolve_wanted(self.state, flagged)
        return keyed_exchange(self.state, scope, send, flagged.document, wanted)
