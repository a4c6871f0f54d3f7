"""Assemble the proxy: routes, the lifespan (connections to vLLM, the rings), per-app state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_hidden_state_proxy.protocol import CAPTURE_PATH
from vllm_hidden_state_proxy.proxy.auth import ApiKeyGuard
from vllm_hidden_state_proxy.proxy.endpoints import ChatApp, PassthroughApp, ResponsesApp
from vllm_hidden_state_proxy.proxy.endpoints.capture import CaptureApp
from vllm_hidden_state_proxy.proxy.endpoints.chat_batch import CHAT_BATCH_PATH, ChatBatchApp
from vllm_hidden_state_proxy.proxy.endpoints.completions import CompletionsApp
from vllm_hidden_state_proxy.proxy.endpoints.embeddings import EmbeddingsApp
from vllm_hidden_state_proxy.proxy.endpoints.ops import HealthApp, MetricsApp
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.state import Connections, ProxyState, RingSource
from vllm_hidden_state_proxy.ring import RingDirectory
from vllm_hidden_state_proxy.transport import create_pool
from vllm_hidden_state_proxy.transport.ops import HEALTH_PATH, METRICS_PATH, OpsClient


class _ExactPaths:
    """The endpoints by method and exact path, ahead of Starlette's router: a dictionary probe
    instead of matching every route's pattern, on every request. Anything else (other paths,
    other methods, lifespan) goes to the router as usual."""

    def __init__(self, router: ASGIApp, routes: list[Route]) -> None:
        self.router = router
        self.exact = {
            (method, route.path): route.app for route in routes for method in route.methods or ()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            app = self.exact.get((scope["method"], scope["path"]))
            if app is not None:
                await app(scope, receive, send)
                return
        try:
            await self.router(scope, receive, send)
        except HTTPException as exc:  # what Starlette's ExceptionMiddleware would answer
            response = PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)
            await response(scope, receive, send)


class _ProxyStarlette(Starlette):
    """Starlette without its two default middlewares: every request would pay for them, and
    the proxy needs neither (its apps answer their own errors, and an exception that escapes
    is answered 500 and logged by uvicorn, as ServerErrorMiddleware would)."""

    def build_middleware_stack(self) -> ASGIApp:
        exact = [route for route in self.routes if isinstance(route, Route) and route.methods]
        app: ASGIApp = _ExactPaths(self.router, exact)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app


def create_app(
    settings: ProxySettings,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    ring: RingSource | None = None,
    metrics: ProxyMetrics | None = None,
) -> Starlette:
    """The proxy as an ASGI app.

    ``transport`` replaces the network towards vLLM (tests: ``httpx.MockTransport``), for the
    requests and the ops routes alike; by default each has a pool of ``--upstream-client``'s
    engine (:func:`~vllm_hidden_state_proxy.transport.create_pool`). ``ring``
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
        engine, uds = settings.upstream_client, settings.upstream_uds
        connections = Connections(
            transport=transport or create_pool(settings.max_connections, uds, engine),
            ops_client=OpsClient(settings.upstream_base, transport, uds=uds, engine=engine),
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
        Route(HEALTH_PATH, HealthApp(state), methods=["GET"]),
        Route(METRICS_PATH, MetricsApp(state), methods=["GET"]),
        Route(CAPTURE_PATH, CaptureApp(state), methods=["GET"]),
        Route("/v1/chat/completions", ChatApp(state), methods=["POST"]),
        Route(CHAT_BATCH_PATH, ChatBatchApp(state), methods=["POST"]),
        Route("/v1/completions", CompletionsApp(state), methods=["POST"]),
        Route("/v1/embeddings", EmbeddingsApp(state), methods=["POST"]),
        Route("/v1/responses", ResponsesApp(state), methods=["POST"]),
        Route("/{path:path}", PassthroughApp(state)),
    ]
    middleware = []
    if settings.api_key:
        middleware.append(
            Middleware(
                ApiKeyGuard, api_key=settings.api_key, protect_metrics=settings.protect_metrics
            )
        )
    app = _ProxyStarlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.proxy = state
    return app
