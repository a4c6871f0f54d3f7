"""OpenAI-shaped error responses produced by the proxy itself.

Shape: ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}``.
Errors coming from vLLM are never rewritten; these are only for decisions the proxy makes.
"""

from __future__ import annotations

import orjson

from vllm_hidden_state_proxy.proxy.asgi import Send, send_response

#: Error ``type`` per HTTP status for the statuses the proxy produces.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class ProxyError(Exception):
    """A request the proxy answers itself, with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status = status
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": _TYPES.get(self.status, "proxy_error"),
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param)


async def send_error(send: Send, error: ProxyError) -> None:
    await send_response(send, error.status, error.body(), b"application/json")
