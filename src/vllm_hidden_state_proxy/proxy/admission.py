"""The first stop of a chat or completions request: read it, inspect it, refuse what the proxy
refuses (413, 400, 503), and resolve what a flagged one asks for against the live rings."""

from __future__ import annotations

from vllm_hidden_state_proxy.proxy.asgi import Receive, Scope, Send, receive_body, send_error
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import (
    Decision,
    Flagged,
    Ordinary,
    WantedVectors,
    inspect_body,
    resolve_layers,
)
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vector_lookup import check_rings


async def read_decision(
    state: ProxyState, scope: Scope, receive: Receive, send: Send
) -> Decision | None:
    """The request as :class:`Ordinary` or :class:`Flagged`; ``None`` if it is already answered
    (413, 400) or abandoned."""
    body = await receive_body(scope, receive, send, state.settings.max_body_bytes)
    if body is None:
        return None
    try:
        decision = inspect_body(body)
    except ProxyError as error:
        await send_error(send, error)
        return None
    if isinstance(decision, Ordinary):
        state.metrics.requests["ordinary"] += 1
    else:
        state.metrics.flagged_received += 1
    return decision


def resolve_wanted(state: ProxyState, flagged: Flagged) -> WantedVectors:
    """What ``flagged`` asks for, in absolute layers of the live rings; ``ProxyError`` (503 no
    ring, 400 a layer not captured) otherwise."""
    shapes = check_rings(state.rings, state.settings.ring_dir)
    wanted = resolve_layers(flagged.vectors, shapes)
    state.metrics.requests["flagged"] += 1
    return wanted
