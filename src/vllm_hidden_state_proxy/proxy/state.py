"""Per-app runtime state: settings, metrics, and the resources the lifespan opens."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.vectors import VectorSource


@dataclass
class ProxyState:
    settings: ProxySettings
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    http: httpx.AsyncBaseTransport | None = None
    ops_http: httpx.AsyncClient | None = None
    vectors: VectorSource | None = None

    @property
    def client(self) -> httpx.AsyncBaseTransport:
        if self.http is None:
            raise RuntimeError("proxy not started: run the app's lifespan first")
        return self.http

    @property
    def ops_client(self) -> httpx.AsyncClient:
        """The small pool for /health and /metrics."""
        if self.ops_http is None:
            raise RuntimeError("proxy not started: run the app's lifespan first")
        return self.ops_http

    @property
    def ring(self) -> VectorSource:
        if self.vectors is None:
            raise RuntimeError("proxy not started: run the app's lifespan first")
        return self.vectors
