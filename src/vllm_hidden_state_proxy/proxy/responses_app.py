"""``POST /v1/responses``: like chat; a flagged stream gets its vectors on ``response.completed``.

vLLM's ``ResponsesRequest`` takes ``vllm_xargs`` and ``kv_transfer_params`` as chat does, and its
response object carries ``kv_transfer_params``: a flagged JSON answer gets the vectors there, a
flagged stream in the final response of its ``response.completed`` event
(:mod:`.responses_stream`). The prompt is what vLLM builds from ``instructions`` (a system
message), ``input`` (a string is one user message) and, with ``previous_response_id``, the
stored conversation before it.
"""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.types import Scope, Send

from vllm_hidden_state_proxy.protocol import ANSWER_POOLINGS, KV, POOLING
from vllm_hidden_state_proxy.proxy.endpoints import GenerationEndpoint, resolve_wanted
from vllm_hidden_state_proxy.proxy.errors import bad_request
from vllm_hidden_state_proxy.proxy.inspection import Flagged
from vllm_hidden_state_proxy.proxy.keyed_exchange import keyed_exchange
from vllm_hidden_state_proxy.proxy.planned_fields import RESPONSES_FIELDS
from vllm_hidden_state_proxy.proxy.responses_stream import relay_responses_with_vectors


class ResponsesApp(GenerationEndpoint):
    planned_fields = RESPONSES_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        if flagged.vectors.pooling in ANSWER_POOLINGS:
            raise bad_request(
                f"'{KV}.{POOLING}': {flagged.vectors.pooling!r} is not supported on "
                "/v1/responses yet: use /v1/chat/completions or /v1/completions for the "
                "answer's hidden state.",
                f"{KV}.{POOLING}",
            )
        wanted = resolve_wanted(self.state, flagged)
        return keyed_exchange(
            self.state,
            scope,
            send,
            flagged.document,
            wanted,
            relay_stream=relay_responses_with_vectors,
        )
