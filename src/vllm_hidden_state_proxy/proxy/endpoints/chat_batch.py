"""``POST /v1/chat/completions/batch``: vLLM's conversations of one request, one choice each;
a flagged batch gets one entry per conversation, in order.

vLLM runs conversation ``i`` as engine request ``"chatcmpl-{request_id}_{i}"`` (and its random
suffix), all with one ``SamplingParams``: sent as one keyed request whose conversations the
hook tells apart by those ids, as a completions prompt list (:mod:`..prompt_list`). The
poolings that a completions list fans out for (``"mean"``, spans, ``"all_prompt"``: their
``cache_salt`` is one per request) are refused here, as is an answer's pooling with ``echo`` or
``include_reasoning: false``, and a batch whose records would take more than a quarter of the
smallest ring's slots: send each conversation to ``/v1/chat/completions``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from starlette.types import Scope, Send

from vllm_hidden_state_proxy.protocol import FLAG, KV, POOLING
from vllm_hidden_state_proxy.proxy.endpoints import GenerationEndpoint, resolve_wanted
from vllm_hidden_state_proxy.proxy.errors import bad_request
from vllm_hidden_state_proxy.proxy.inspection import Flagged
from vllm_hidden_state_proxy.proxy.planned_fields import CHAT_FIELDS
from vllm_hidden_state_proxy.proxy.prompt_list import prompt_list_exchange, why_not_one_request

#: The path, as vLLM 0.32 registers it (``chat_completion/api_router.py``).
CHAT_BATCH_PATH = "/v1/chat/completions/batch"


def conversation_list(document: dict[str, Any], limit: int) -> list[Any]:
    """The conversations of a flagged batch; ``ProxyError`` 400 for what is not a non-empty
    list of them, or more than ``limit`` (the proxy's ``--max-prompts``)."""
    conversations = document.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise bad_request("'messages' must be a non-empty list of conversations.", "messages")
    if len(conversations) > limit:  # before any work per conversation
        raise bad_request(
            f"'messages' is a list of {len(conversations)} conversations; with {KV}.{FLAG} at "
            f"most {limit} are allowed per request (the proxy's --max-prompts): send the rest "
            "in further requests.",
            "messages",
        )
    for index, conversation in enumerate(conversations):
        if not isinstance(conversation, list) or not conversation:
            raise bad_request(
                f"'messages[{index}]' must be a non-empty list of messages.", "messages"
            )
    return conversations


class ChatBatchApp(GenerationEndpoint):
    planned_fields = CHAT_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        document = flagged.document
        conversations = conversation_list(document, self.state.settings.max_prompts)
        wanted = resolve_wanted(self.state, flagged)
        slots = self.state.rings.smallest_slot_count()
        why = why_not_one_request(document, wanted, len(conversations), slots)
        if why is not None:
            raise bad_request(
                f"A flagged {CHAT_BATCH_PATH} is one vLLM request, and here {why}: send fewer "
                "conversations, or each to /v1/chat/completions.",
                "messages" if "slots" in why else f"{KV}.{POOLING}",
            )
        return prompt_list_exchange(
            self.state, scope, send, document, wanted, conversations, form="chatcmpl"
        )
