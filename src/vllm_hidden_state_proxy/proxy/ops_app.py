"""``GET /health`` and ``GET /metrics``: operational endpoints that consult vLLM too."""

from __future__ import annotations

import anyio
import httpx

from vllm_hidden_state_proxy.proxy.asgi import Receive, Scope, Send, send_error, send_response
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.metrics import CONTENT_TYPE
from vllm_hidden_state_proxy.proxy.state import ProxyState


async def _get_upstream(state: ProxyState, path: str, accept: str) -> httpx.Response:
    """GET ``path`` from vLLM with an overall deadline of ``health_timeout``.

    Raises ``TimeoutError`` or ``httpx.HTTPError``.
    """
    settings = state.settings
    with anyio.fail_after(settings.health_timeout):
        return await state.ops_client.get(
            settings.upstream_base + path,
            headers={"accept": accept},
            timeout=settings.health_timeout,
        )


def not_ready_reason(state: ProxyState) -> str | None:
    """Why the proxy is not ready although vLLM is, or ``None``:

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
        return None
    publishing = rings.publishing_instances()
    why = [
        failure
        for failure in failures
        if failure.instance in publishing or (failure.fatal and not publishing)
    ]
    if not why:
        return None
    return "; ".join(failure.describe() for failure in why)


class HealthApp:
    """200 only if vLLM's own ``/health`` answers 200 within ``health_timeout`` and
    :func:`not_ready_reason` finds nothing."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = self.state.settings.upstream_url
        try:
            response = await _get_upstream(self.state, "/health", "*/*")
        except TimeoutError:
            timeout = self.state.settings.health_timeout
            problem = f"/health did not answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            problem = f"{exc!r}"
        else:
            if response.status_code == 200:
                missing = not_ready_reason(self.state)
                if missing is None:
                    await send_response(send, 200, b"", b"text/plain; charset=utf-8")
                    return
                message = f"vLLM at {upstream} is healthy, but {missing}."
                await send_error(send, ProxyError(503, message))
                return
            problem = f"/health answered {response.status_code}"
        await send_error(send, ProxyError(503, f"vLLM at {upstream} is not healthy: {problem}."))


class MetricsApp:
    """vLLM's ``/metrics`` text followed by the proxy's own metrics.

    If vLLM's metrics cannot be fetched, the proxy's own are still returned.
    """

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = await self._upstream_metrics()
        if upstream and not upstream.endswith(b"\n"):
            upstream += b"\n"
        rings = self.state.rings
        own = self.state.metrics.render(
            live_rings=rings.live_ring_count(), engines_without_ring=len(rings.failed_engines())
        )
        await send_response(send, 200, upstream + own, CONTENT_TYPE)

    async def _upstream_metrics(self) -> bytes:
        try:
            response = await _get_upstream(self.state, "/metrics", "text/plain")
        except (TimeoutError, httpx.HTTPError):
            return b""
        return response.content if response.status_code == 200 else b""
