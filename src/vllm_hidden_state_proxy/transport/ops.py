"""One client for vLLM's ops routes: ``GET /health``, ``/metrics`` and ``/v1/models``.

The proxy's ``/health``, ``/metrics`` and ``GET /v1/hidden_states`` consult vLLM's. They go
through a pool of their own (a few connections of the same engine as the proxy's requests,
:func:`~vllm_hidden_state_proxy.transport.create_pool`), so that readiness probes keep
answering when every connection of the main pool is busy with long generations; and each
read is bounded as a whole (connect, send, body), so a vLLM that hangs costs a probe its
timeout, no more.

The routes' paths are written here once: the proxy serves ``/health`` and ``/metrics`` under
the same paths, and ``check`` reads them (and ``/version``) through the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import httpx

from vllm_hidden_state_proxy.transport import create_pool

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODELS_PATH = "/v1/models"
#: vLLM's version (the proxy passes it through; ``check`` prints it).
VERSION_PATH = "/version"

#: Connections of the ops pool: probes and scrapes, one or two at a time.
OPS_CONNECTIONS = 4


@dataclass(frozen=True)
class OpsReply:
    """vLLM's reply to an ops GET, read whole."""

    status: int
    content: bytes


class OpsClient:
    """GETs of vLLM's ops routes at ``base_url`` over ``transport`` (default: a small pool of
    ``engine``'s, over ``uds`` if given)."""

    def __init__(
        self,
        base_url: str,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        uds: str | None = None,
        engine: str = "http1",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.transport = transport or create_pool(OPS_CONNECTIONS, uds, engine)

    async def get(
        self, path: str, timeout: float, accept: str = "*/*", authorization: str | None = None
    ) -> OpsReply:
        """GET ``path``, its whole reply within ``timeout`` seconds. Raises ``TimeoutError``
        or ``httpx.HTTPError``."""
        headers = [(b"accept", accept.encode("latin-1"))]
        if authorization is not None:
            headers.append((b"authorization", authorization.encode("latin-1")))
        request = httpx.Request(
            "GET",
            self.base_url + path,
            headers=headers,
            extensions={
                "timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
            },
        )
        with anyio.fail_after(timeout):
            response = await self.transport.handle_async_request(request)
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        return OpsReply(response.status_code, content)

    async def aclose(self) -> None:
        await self.transport.aclose()
