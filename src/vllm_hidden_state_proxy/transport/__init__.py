"""How this package talks HTTP: one place for the proxy (to vLLM), ``extract`` (to the proxies)
and ``check`` (the ops routes' paths).

Every sender holds an ``httpx.AsyncBaseTransport`` (httpx's one base class of transports): the
same code then talks to a real server, an in-process fake (``httpx.MockTransport``) or an ASGI
app. The proxy calls its ``handle_async_request`` directly, not through an
``httpx.AsyncClient``, whose layers (auth, redirects, cookie jar, event hooks, default headers)
are work a proxy must not do; ``extract`` wraps it in a client. The pool under it is built here
(:func:`create_pool`), by one of three engines (the proxy's ``--upstream-client``):

- ``http1`` (the default, :mod:`.http1`): the proxy's own HTTP/1.1 pool on asyncio protocols
  and httptools, the least CPU per request (issue #46);
- ``aiohttp`` (:mod:`.aiohttp_client`): aiohttp's client under httpx's interface;
- ``httpx``: httpx's own (httpcore).

- :mod:`.http1` (one connection: :mod:`.http1_connection`), :mod:`.aiohttp_client`: the two
  engines of this package;
- :mod:`.ops`: one client for vLLM's ops routes (``/health``, ``/metrics``, ``/v1/models``),
  on a small pool of the same engine, and those routes' paths (``check`` reads them too).
"""

from __future__ import annotations

from collections.abc import AsyncIterable

import anyio
import httpx

from vllm_hidden_state_proxy.transport.aiohttp_client import AiohttpTransport
from vllm_hidden_state_proxy.transport.closing import ClosesAtOnce
from vllm_hidden_state_proxy.transport.http1 import Http1Transport

#: Seconds an idle pooled connection to vLLM is kept: vLLM (uvicorn) closes idle connections
#: after 5 s, so ours are retired first and a request never goes out on a connection the
#: server is closing. (The proxy is a uvicorn server too: ``extract`` keeps the same.)
KEEPALIVE_EXPIRY = 2.0

#: The engines under httpx's interface (``--upstream-client``).
ENGINES = ("http1", "aiohttp", "httpx")


def create_pool(
    max_connections: int | None, uds: str | None = None, engine: str = "http1"
) -> httpx.AsyncBaseTransport:
    """A pool of at most ``max_connections`` connections (``None``: no bound) to vLLM, over the
    Unix socket ``uds`` if given (``vllm serve --uds``; the URL's host is then ignored), by
    ``engine`` (one of :data:`ENGINES`). Timeouts travel in each request (httpx's ``timeout``
    extension)."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    if engine == "httpx":
        return httpx.AsyncHTTPTransport(limits=limits, trust_env=False, uds=uds)
    if engine == "aiohttp":
        return AiohttpTransport(limits=limits, uds=uds)
    return Http1Transport(limits=limits, uds=uds)


def body_chunks(response: httpx.Response) -> AsyncIterable[bytes]:
    """A response's raw body as it arrives: its stream itself where it is async (every engine's
    and httpx's mock's), without ``aiter_raw``'s layers (a generator, a chunker, a context
    manager: ~3 µs a response, issue #46). The caller closes the response."""
    stream = response.stream
    if isinstance(stream, httpx.AsyncByteStream):
        return stream
    return response.aiter_raw()


async def close_quietly(response: httpx.Response) -> None:
    """Close a response from vLLM even while being cancelled (a client disconnect).

    The engines' responses (http1's, aiohttp's) close without suspending, so nothing can cancel
    that; any other transport's close is shielded (a cancel scope per request is measurable
    CPU).
    """
    if isinstance(response.stream, ClosesAtOnce):
        await response.aclose()
        return
    with anyio.CancelScope(shield=True):
        await response.aclose()
