"""Run the proxy under uvicorn (uvloop + httptools, no access log), in one or more processes,
with the front server's limits: request heads by size and time (``http_protocol.py``), open
connections (uvicorn's ``limit_concurrency``); request bodies are bounded in ``asgi.py``. Why
uvicorn and not granian: docs/benchmark.md.

With ``--workers N`` uvicorn's supervisor binds the port once and starts N worker processes
that share it; each builds the app from the settings the server hands over in its environment,
maps every ring itself, and counts into its own row of a shared metrics table.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import uvicorn
from starlette.applications import Starlette

from vllm_hidden_state_proxy.protocol import WORKER_METRICS_ENV, WORKER_SETTINGS_ENV
from vllm_hidden_state_proxy.proxy.app import create_app
from vllm_hidden_state_proxy.proxy.http_protocol import protocol_factory
from vllm_hidden_state_proxy.proxy.metrics import MetricsTable, ProxyMetrics
from vllm_hidden_state_proxy.proxy.settings import ProxySettings


def _options(settings: ProxySettings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        # httptools, with the limits on request heads it lacks (and that pickles for workers).
        "http": protocol_factory(settings.max_head_bytes, settings.head_timeout),
        # A request arriving while this many connections are open or requests run: 503.
        "limit_concurrency": settings.max_client_connections,
        "lifespan": "on",
        "access_log": False,
        "proxy_headers": False,  # the proxy never looks at the client address
        "log_level": settings.log_level,
        # After SIGTERM: no new connections, requests in flight get this long (--drain-timeout).
        "timeout_graceful_shutdown": settings.drain_timeout,
        # vLLM's own Date/Server headers pass through; uvicorn must not add second copies.
        "server_header": False,
        "date_header": False,
    }


def server_config(settings: ProxySettings) -> uvicorn.Config:
    """One process serving the app (``--workers 1``)."""
    return uvicorn.Config(create_app(settings), **_options(settings))


def worker_app() -> Starlette:
    """The app of one worker process, from what the server put in its environment."""
    settings = ProxySettings.from_json(os.environ[WORKER_SETTINGS_ENV])
    metrics = ProxyMetrics(MetricsTable(os.environ[WORKER_METRICS_ENV]))
    return create_app(settings, metrics=metrics)


def serve_proxy(settings: ProxySettings) -> None:
    """Serve until interrupted (blocking)."""
    if settings.workers == 1:
        uvicorn.Server(server_config(settings)).run()
        return
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    metrics_file = MetricsTable.create_shared(directory)
    os.environ[WORKER_SETTINGS_ENV] = settings.to_json()
    os.environ[WORKER_METRICS_ENV] = str(metrics_file)
    try:
        uvicorn.run(
            f"{__name__}:worker_app", factory=True, workers=settings.workers, **_options(settings)
        )
    finally:
        MetricsTable.remove_shared(metrics_file)
