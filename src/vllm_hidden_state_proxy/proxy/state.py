"""Per-app runtime state: settings, metrics, the budgets of buffered request bodies and of vectors,
and what the lifespan opens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx

from vllm_hidden_state_proxy.proxy.asgi import BodyBudget
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.vectors.memory import VectorMemory
from vllm_hidden_state_proxy.ring import (
    EngineFailure,
    Found,
    PendingRows,
    PublishMarks,
    RingHeader,
    RingShape,
)
from vllm_hidden_state_proxy.transport.ops import OpsClient


class RingSource(Protocol):
    """What the proxy needs from ``ring.RingDirectory`` (tests may pass a fake)."""

    def lookup(self, key: bytes) -> Found | None: ...

    def find(self, key: bytes) -> Found | PendingRows | None: ...

    def has_ring(self) -> bool: ...

    def live_ring_count(self) -> int: ...

    def live_shapes(self) -> tuple[RingShape, ...]: ...

    def live_headers(self) -> tuple[RingHeader, ...]: ...

    def failed_engines(self) -> tuple[EngineFailure, ...]: ...

    def refusal(self) -> str | None: ...

    def publishing_instances(self) -> frozenset[int]: ...

    def publish_marks(self) -> PublishMarks: ...

    def overwritten_since(self, marks: PublishMarks) -> bool: ...

    def smallest_slot_count(self) -> int | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Connections:
    """What the lifespan opens: the pool towards vLLM, the client of its ops routes (a small
    pool of its own), the rings."""

    transport: httpx.AsyncBaseTransport
    ops_client: OpsClient
    rings: RingSource


class ProxyState:
    """Shared by the endpoint apps of one proxy; ``connections`` is set while the app runs."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or ProxyMetrics()
        #: This process's request bodies in memory, against ``--body-budget``.
        self.body_budget = BodyBudget(settings.body_budget_bytes)
        #: This process's vectors and matrices in memory, against ``--vectors-budget``.
        self.vector_memory = VectorMemory(
            settings.vectors_budget_bytes, settings.max_vectors_bytes, self.metrics
        )
        self.connections: Connections | None = None

    def _open(self) -> Connections:
        if self.connections is None:
            raise RuntimeError("proxy not started: run the app's lifespan first")
        return self.connections

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """The pooled connection set towards vLLM (requests are sent through it directly)."""
        return self._open().transport

    @property
    def ops_client(self) -> OpsClient:
        """vLLM's /health, /metrics and /v1/models, over a small pool of their own."""
        return self._open().ops_client

    @property
    def rings(self) -> RingSource:
        return self._open().rings
