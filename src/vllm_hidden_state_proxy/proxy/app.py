"""Assemble the proxy: routes, the lifespan (connections to vLLM, the rings), per-app state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from vllm_hidden_state_proxy.proxy.auth import ApiKeyGuard
from vllm_hidden_state_proxy.proxy.chat_app import ChatApp
from vllm_hidden_state_proxy.proxy.completions_app import CompletionsApp
from vllm_hidden_state_proxy.proxy.embeddings_app import EmbeddingsApp
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.ops_app import HealthApp, MetricsApp
from vllm_hidden_state_proxy.proxy.passthrough_app import PassthroughApp
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.state import Connections, ProxyState
from vllm_hidden_state_proxy.proxy.upstream import create_ops_client, create_transport
from vllm_hidden_state_proxy.proxy.vector_lookup import RingSource
from vllm_hidden_state_proxy.ring import RingDirectory


def create_app(
    settings: ProxySettings,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    ring: RingSource | None = None,
    metrics: ProxyMetrics | None = None,
) -> Starlette:
    """The proxy as an ASGI app.

    ``transport`` replaces the network towards vLLM (tests: ``httpx.MockTransport``). ``ring``
    replaces ``RingDirectory(settings.ring_dir)``; a ring passed in is not closed at shutdown.
    The connections and the ring directory are opened by the lifespan, so the lifespan must
    run before requests (uvicorn does; with ``httpx.ASGITransport`` enter
    ``app.router.lifespan_context(app)``). The state is reachable as ``app.state.proxy``.
    ``metrics``: this process's counters (a worker's row of a shared table); private ones
    by default.
    """
    state = ProxyState(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rings = ring or RingDirectory(settings.ring_dir, owner_uids=settings.ring_owner_uids)
        connections = Connections(
            transport=create_transport(settings, transport),
            ops_client=create_ops_client(settings, transport),
            rings=rings,
        )
        state.connections = connections
        try:
            yield
        finally:
            state.connections = None
            await connections.transport.aclose()
            await connections.ops_client.aclose()
            if ring is None:
                rings.close()

    routes = [
        Route("/health", HealthApp(state), methods=["GET"]),
        Route("/metrics", MetricsApp(state), methods=["GET"]),
        Route("/v1/chat/completions", ChatApp(state), methods=["POST"]),
        Route("/v1/completions", CompletionsApp(state), methods=["POST"]),
        Route("/v1/embeddings", EmbeddingsApp(state), methods=["POST"]),
        Route("/{path:path}", PassthroughApp(state)),
    ]
    middleware = []
    if settings.api_key:
        middleware.append(
            Middleware(
                ApiKeyGuard, api_key=settings.api_key, protect_metrics=settings.protect_metrics
            )
        )
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.proxy = state
    return app
