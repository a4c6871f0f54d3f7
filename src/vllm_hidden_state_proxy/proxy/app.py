"""Assemble the proxy: routes, lifespan (pooled client + ring directory), per-app state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from vllm_hidden_state_proxy.proxy.auth import ApiKeyGuard
from vllm_hidden_state_proxy.proxy.chat import GenerationApp
from vllm_hidden_state_proxy.proxy.embeddings import EmbeddingsApp
from vllm_hidden_state_proxy.proxy.ops import HealthApp, MetricsApp
from vllm_hidden_state_proxy.proxy.passthrough import PassthroughApp
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.upstream import create_ops_client, create_transport
from vllm_hidden_state_proxy.proxy.vectors import VectorSource
from vllm_hidden_state_proxy.ring import RingDirectory


def create_app(
    settings: ProxySettings,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    ring: VectorSource | None = None,
) -> Starlette:
    """The proxy as an ASGI app.

    ``transport`` replaces the network towards vLLM (tests: ``httpx.MockTransport``). ``ring``
    replaces ``RingDirectory(settings.ring_dir)``; a ring passed in is not closed at shutdown.
    The pooled client and the ring directory are opened by the lifespan, so the lifespan must
    run before requests (uvicorn does; with ``httpx.ASGITransport`` enter
    ``app.router.lifespan_context(app)``). The state is reachable as ``app.state.proxy``.
    """
    state = ProxyState(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned = ring is None
        if ring is None:
            state.vectors = RingDirectory(settings.ring_dir, expected_uid=settings.ring_owner_uids)
        else:
            state.vectors = ring
        state.http = create_transport(settings, transport)
        state.ops_http = create_ops_client(settings, transport)
        try:
            yield
        finally:
            await state.http.aclose()
            await state.ops_http.aclose()
            state.http = state.ops_http = None
            if owned:
                state.vectors.close()
            state.vectors = None

    routes = [
        Route("/health", HealthApp(state), methods=["GET"]),
        Route("/metrics", MetricsApp(state), methods=["GET"]),
        Route("/v1/chat/completions", GenerationApp(state, completions=False), methods=["POST"]),
        Route("/v1/completions", GenerationApp(state, completions=True), methods=["POST"]),
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
