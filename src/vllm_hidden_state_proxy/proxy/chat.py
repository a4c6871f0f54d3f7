"""``POST /v1/chat/completions``: ordinary requests pass through, flagged ones get their vector."""

from __future__ import annotations

from typing import Any

import httpx

from vllm_hidden_state_proxy.protocol import key_to_wire, new_key
from vllm_hidden_state_proxy.proxy.asgi import (
    Receive,
    Scope,
    Send,
    run_until_disconnect,
    send_response,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, send_error
from vllm_hidden_state_proxy.proxy.flag import (
    Flagged,
    completion_with_vector,
    flagged_request_body,
    inspect_chat_body,
    parse_completion,
)
from vllm_hidden_state_proxy.proxy.forward import (
    close_quietly,
    forward,
    open_upstream,
    relay_response,
)
from vllm_hidden_state_proxy.proxy.headers import downstream_response_headers
from vllm_hidden_state_proxy.proxy.passthrough import receive_body
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.upstream import build_request, transport_error
from vllm_hidden_state_proxy.proxy.vectors import wait_for_vector

#: Upstream headers not copied onto the rebuilt 200 response (the proxy sets its own).
_REBUILT_DROP = frozenset({b"content-length", b"content-type", b"content-encoding"})


def no_ring_error(ring_dir: str) -> ProxyError:
    return ProxyError(
        503,
        "The hidden-state worker hook is not active in the vLLM environment: install "
        "vllm-hidden-state-proxy into vLLM's Python environment (it registers a "
        "`vllm.general_plugins` entry point), make sure VLLM_PLUGINS (if set) includes "
        f"`hidden_state_hook`, and that vLLM and the proxy use the same ring directory "
        f"({ring_dir}) on shared memory.",
    )


def vector_timeout_error(timeout: float) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state did not arrive within {timeout:g} s: the request's generation is "
        "complete but the hidden state was not published by the vLLM worker hook.",
    )


def vector_overwritten_error(slots: int | None) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state was overwritten in the shared-memory ring ({slots} slots) before the "
        "response was complete: more flagged prompts were prefilled meanwhile than the ring "
        "holds. Retry, or raise HIDDEN_STATE_PROXY_RING_SLOTS in vLLM's environment.",
    )


class ChatCompletionsApp:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        body = await receive_body(state, scope, receive, send)
        if body is None:
            return
        try:
            decision = inspect_chat_body(body)
            if isinstance(decision, Flagged):
                state.metrics.flagged_received += 1
                if not state.ring.has_ring():
                    raise no_ring_error(state.settings.ring_dir)
        except ProxyError as error:
            await send_error(send, error)
            return
        if isinstance(decision, Flagged):
            state.metrics.requests["flagged"] += 1
            document = decision.document
            await run_until_disconnect(
                receive, lambda: flagged_exchange(state, scope, send, document)
            )
        else:
            state.metrics.requests["ordinary"] += 1
            forwarded = decision.body
            await run_until_disconnect(receive, lambda: forward(state, scope, send, forwarded))


async def flagged_exchange(
    state: ProxyState, scope: Scope, send: Send, document: dict[str, Any]
) -> None:
    """Forward a flagged request with a fresh key; answer with the vector joined in."""
    settings = state.settings
    key = new_key()
    body = flagged_request_body(document, key_to_wire(key))
    published_before = state.ring.publish_count()
    try:
        response = await open_upstream(state, build_request(settings, scope, body))
    except ProxyError as error:
        await send_error(send, error)
        return
    try:
        if response.status_code != 200:
            await relay_response(state, send, response)  # vLLM's own error, unchanged
            return
        try:
            await response.aread()
        except httpx.HTTPError as exc:  # broken connection, undecodable content-encoding
            state.metrics.upstream_errors += 1
            await send_error(send, transport_error(settings, exc))
            return
    finally:
        await close_quietly(response)

    completion = parse_completion(response.content)
    if completion is None:
        await send_error(
            send, ProxyError(502, "vLLM answered 200 with a body that is not a JSON object.")
        )
        return
    wait = await wait_for_vector(state.ring, key, settings.vector_timeout, published_before)
    if wait.record is None:
        if wait.overwritten:
            state.metrics.vector_misses["overwritten"] += 1
            await send_error(send, vector_overwritten_error(state.ring.min_slot_count()))
        else:
            state.metrics.vector_misses["not_published"] += 1
            await send_error(send, vector_timeout_error(settings.vector_timeout))
        return
    state.metrics.vector_wait.observe(wait.waited)
    payload = completion_with_vector(completion, wait.record.as_floats())
    headers = downstream_response_headers(response.headers.raw, drop=_REBUILT_DROP)
    await send_response(send, 200, payload, b"application/json", headers)
