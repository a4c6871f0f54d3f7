"""An httpx transport on aiohttp's client: httpx's API, a cheaper engine under it.

Whatever talks HTTP to vLLM (the proxy, ``extract``) speaks through
``httpx.AsyncBaseTransport.handle_async_request`` only, so the engine underneath is a choice.
httpx's default (httpcore over anyio sockets and h11) costs about as much CPU per request as
the rest of the proxy together; aiohttp's client, written for asyncio with a C HTTP parser,
costs a fraction (``docs/benchmark.md``, the instant-upstream arm).
The ``httpx-aiohttp`` package does the same with defaults a proxy cannot keep (it lets aiohttp
add ``User-Agent``, ``Accept`` and ``Accept-Encoding`` headers the client never sent, and reads
fixed 16 KiB chunks), hence this small transport:

- requests go out with exactly the headers given (raw names and values, no additions but
  ``Host``), the body as bytes, no redirects, no cookies, no decompression;
- the response's status, raw headers and body chunks, as they arrive, come back as an
  ``httpx.Response`` whose stream, closed early (a client disconnect), closes the connection
  instead of returning it to the pool, so vLLM sees the disconnect and aborts the request;
- httpx's per-request ``timeout`` extension (connect, read) applies; "pool" waits forever;
- aiohttp's errors become httpx's (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``ReadError``, ``RemoteProtocolError``), which the proxy maps to 502/504;
- ``uds`` connects over a Unix domain socket (``vllm serve --uds``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
from multidict import CIMultiDict

from vllm_hidden_state_proxy.transport.closing import ClosesAtOnce

#: Headers aiohttp would add on its own: the proxy sends what the client sent, nothing more.
_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


@contextlib.contextmanager
def _httpx_errors(request: httpx.Request) -> Iterator[None]:
    """aiohttp's exceptions as the httpx exceptions the proxy understands."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=request) from exc
    except (aiohttp.SocketTimeoutError, asyncio.TimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timeout", request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientResponseError as exc:  # a response vLLM could not have meant
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc


class _ResponseStream(ClosesAtOnce):
    """The body as aiohttp delivers it; closing it early drops the connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        response = self._response
        if response.content.at_eof():
            response.release()  # complete: the connection can serve the next request
        else:
            response.close()  # abandoned mid-body: close it so that vLLM sees the client go


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, limits: httpx.Limits, uds: str | None = None) -> None:
        self._limits = limits
        self._uds = uds
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        limit = self._limits.max_connections or 0
        keepalive = self._limits.keepalive_expiry
        connector: aiohttp.BaseConnector
        if self._uds is not None:
            connector = aiohttp.UnixConnector(
                path=self._uds, limit=limit, keepalive_timeout=keepalive
            )
        else:
            connector = aiohttp.TCPConnector(
                limit=limit, limit_per_host=0, keepalive_timeout=keepalive, ttl_dns_cache=None
            )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO_HEADERS,
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session
        if session is None:
            session = self._session = self._open_session()
        timeouts = request.extensions.get("timeout") or {}
        headers = CIMultiDict(
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in request.headers.raw
            if name.lower() != b"host"
        )
        with _httpx_errors(request):
            response = await session.request(
                request.method,
                str(request.url),
                headers=headers,
                data=request.content or None,
                allow_redirects=False,
                compress=None,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=timeouts.get("connect"),
                    sock_read=timeouts.get("read"),
                ),
            )
        extensions = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("latin-1", "replace")
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_ResponseStream(response, request),
            request=request,
            extensions=extensions,
        )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
