"""``GET /health`` and ``GET /metrics``: operational endpoints that consult vLLM too."""

from __future__ import annotations

import httpx
from starlette.types import Receive, Scope, Send

from vllm_hidden_state_proxy.proxy.asgi import send_error, send_response
from vllm_hidden_state_proxy.proxy.auth import has_api_key
from vllm_hidden_state_proxy.proxy.errors import engines_not_ready, vllm_not_healthy
from vllm_hidden_state_proxy.proxy.metrics import CONTENT_TYPE
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.ring import EngineFailure
from vllm_hidden_state_proxy.transport.ops import HEALTH_PATH, METRICS_PATH


def not_ready_failures(state: ProxyState) -> list[EngineFailure]:
    """The engines that make the proxy not ready although vLLM is (none: ready):

    - some engine of a vLLM whose other engines publish has no ring, so a share of flagged
      requests would fail (routing decides which);
    - no ring is live and a live engine's note is fatal (its hook refused the server's own
      settings, or this vLLM lacks what the hook reads): what the operator asked for is not
      served at all.

    A vLLM whose hook is merely off everywhere is neither: every flagged request gets a clear
    503, and ordinary traffic should keep flowing.
    """
    rings = state.rings
    failures = rings.failed_engines()
    if not failures:
        return []
    publishing = rings.publishing_instances()
    return [
        failure
        for failure in failures
        if failure.instance in publishing or (failure.fatal and not publishing)
    ]


class HealthApp:
    """200 only if vLLM's own ``/health`` answers 200 within ``health_timeout`` and
    :func:`not_ready_failures` finds none.

    Probes and anyone else get the reason in words only; paths, pids, vLLM's address and
    exception text are for requests that carry the proxy's API key (and the proxy's log)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.state.settings
        detailed = has_api_key(scope, settings.api_key)
        vllm = f"vLLM at {settings.upstream_url}" if detailed else "vLLM"
        try:
            reply = await self.state.ops_client.get(HEALTH_PATH, settings.health_timeout)
        except TimeoutError:
            problem = detail = f"its /health did not answer within {settings.health_timeout:g} s"
        except httpx.HTTPError as exc:
            problem, detail = "it cannot be reached", f"{exc!r}"
        else:
            if reply.status == 200:
                failures = not_ready_failures(self.state)
                if not failures:
                    await send_response(send, 200, b"", b"text/plain; charset=utf-8")
                    return
                said = (
                    failure.describe() if detailed else failure.summary() for failure in failures
                )
                await send_error(send, engines_not_ready(vllm, "; ".join(said)))
                return
            problem = detail = f"its /health answered {reply.status}"
        await send_error(send, vllm_not_healthy(vllm, detail if detailed else problem))


class MetricsApp:
    """vLLM's ``/metrics`` text followed by the proxy's own metrics.

    If vLLM's metrics cannot be fetched (within ``--metrics-upstream-timeout``, with a 200),
    the proxy's own are still returned, with ``hidden_state_proxy_upstream_metrics_up`` 0: a
    scrape that lacks vLLM's series says so instead of looking like vLLM has none.
    """

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = await self._upstream_metrics()
        if upstream and not upstream.endswith(b"\n"):
            upstream += b"\n"
        rings = self.state.rings
        own = self.state.metrics.render(
            live_rings=rings.live_headers(),
            engines_without_ring=len(rings.failed_engines()),
            upstream_metrics_up=upstream is not None,
        )
        await send_response(send, 200, (upstream or b"") + own, CONTENT_TYPE)

    async def _upstream_metrics(self) -> bytes | None:
        """vLLM's metrics text, or None if they could not be fetched."""
        timeout = self.state.settings.metrics_upstream_timeout
        try:
            reply = await self.state.ops_client.get(METRICS_PATH, timeout, accept="text/plain")
        except (TimeoutError, httpx.HTTPError):
            return None
        return reply.content if reply.status == 200 else None
