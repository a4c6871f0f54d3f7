"""Run the proxy under uvicorn (uvloop + httptools, no access log)."""

from __future__ import annotations

import uvicorn

from vllm_hidden_state_proxy.proxy.app import create_app
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

#: Seconds to let in-flight requests finish on shutdown before cutting them.
GRACEFUL_SHUTDOWN_SECONDS = 5


def server_config(settings: ProxySettings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # the proxy never looks at the client address
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        # vLLM's own Date/Server headers pass through; uvicorn must not add second copies.
        server_header=False,
        date_header=False,
    )


def serve_proxy(settings: ProxySettings) -> None:
    """Serve until interrupted (blocking)."""
    uvicorn.Server(server_config(settings)).run()
