"""Optional API key for the proxy: ``Authorization: Bearer <key>``, compared in constant time.

Every path needs the key except ``GET /health`` (probes) and, unless ``protect_metrics`` is
set, ``GET /metrics`` (scrapers). A missing or wrong key gets 401 in the OpenAI error shape.
The client's ``Authorization`` header passes through to vLLM unchanged, so vLLM's own
``--api-key`` keeps working when it is the same key; ``upstream_api_key`` replaces it on the way
to vLLM when vLLM's key differs (see ``upstream.build_request``).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import header_value, send_response
from vllm_hidden_state_proxy.proxy.errors import missing_api_key
from vllm_hidden_state_proxy.transport.ops import HEALTH_PATH, METRICS_PATH

_BEARER = b"bearer "


def bearer_token(scope: Scope) -> bytes | None:
    value = header_value(scope, b"authorization")
    if value is None or value[: len(_BEARER)].lower() != _BEARER:
        return None
    return value[len(_BEARER) :].strip()


def has_api_key(scope: Scope, api_key: str | None) -> bool:
    """Whether the request carries the proxy's API key (never, when it has none)."""
    if not api_key:
        return False
    token = bearer_token(scope)
    # compare_digest takes time independent of where the first difference is.
    return token is not None and hmac.compare_digest(token, api_key.encode("utf-8"))


class ApiKeyGuard:
    """ASGI middleware: refuse HTTP requests without the right Bearer token."""

    def __init__(self, app: ASGIApp, *, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._api_key = api_key
        open_paths = {HEALTH_PATH} if protect_metrics else {HEALTH_PATH, METRICS_PATH}
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        if not has_api_key(scope, self._api_key):
            error = missing_api_key()
            await send_response(
                send, 401, error.body(), b"application/json", [(b"www-authenticate", b"Bearer")]
            )
            return
        await self.app(scope, receive, send)
