"""The requests to vLLM: built from the client's (path, query, headers), sent through the
transport (:mod:`vllm_hidden_state_proxy.transport`), and its failures mapped to the errors the
client sees."""

from __future__ import annotations

import functools
import logging
import time

import httpx
from starlette.types import Scope

from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    exchange_failed,
    stream_broke_off,
    stream_stalled,
    vllm_timeout,
    vllm_unreachable,
)
from vllm_hidden_state_proxy.proxy.headers import upstream_request_headers
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.proxy.state import ProxyState

log = logging.getLogger(__name__)

_AUTHORIZATION = frozenset({b"authorization"})


def upstream_url(settings: ProxySettings, scope: Scope) -> httpx.URL:
    """``upstream_url + path + query`` for the incoming request, path bytes kept verbatim."""
    raw_path: bytes | None = scope.get("raw_path")
    # Some servers (httpx's ASGITransport before 0.28) put the query in raw_path; ASGI says not to.
    path = raw_path.split(b"?", 1)[0].decode("latin-1") if raw_path else scope["path"]
    query: bytes = scope.get("query_string", b"")
    url = settings.upstream_base + path
    if query:
        url = f"{url}?{query.decode('latin-1')}"
    # httpx's URL parsing is a good part of a request's cost, and most requests share a URL.
    return _parsed(url) if len(url) <= _CACHED_URL_LENGTH else httpx.URL(url)


#: URLs up to this long are cached (at most 1024 of them: a bounded amount of memory).
_CACHED_URL_LENGTH = 512


@functools.lru_cache(maxsize=1024)
def _parsed(url: str) -> httpx.URL:
    return httpx.URL(url)


def build_request(
    settings: ProxySettings, scope: Scope, body: bytes, drop: frozenset[bytes] = frozenset()
) -> httpx.Request:
    """The request to vLLM: same method, path, query and headers (minus hop-by-hop).

    Built as a bare ``httpx.Request`` (not ``client.build_request``) so that no client default
    headers (User-Agent, Accept-Encoding, cookies) are added to what the client sent; and with
    its body as a ``stream``, its ``Host`` and ``Content-Length`` set here, so that httpx does
    not look through the headers for them again (a measurable part of the hop, issue #46).
    """
    if settings.upstream_api_key:  # vLLM has a key of its own: it replaces the client's
        drop = drop | _AUTHORIZATION
    headers = upstream_request_headers(scope["headers"], len(body), drop)
    if settings.upstream_api_key:
        headers.append((b"authorization", f"Bearer {settings.upstream_api_key}".encode()))
    url = upstream_url(settings, scope)
    method: str = scope["method"]
    # What httpx would add: Host (the URL's host, and port unless the scheme's default) first,
    # and a length for a POST without a body (upstream_request_headers puts one last if any).
    if (
        not body
        and method in _BODY_METHODS
        and (not headers or headers[-1][0] != b"content-length")
    ):
        headers.append((b"content-length", b"0"))
    headers.insert(0, (b"Host", url.netloc))
    request = httpx.Request(
        method,
        url,
        headers=headers,
        stream=httpx.ByteStream(body),
        # The transport is called directly (no AsyncClient), so the timeouts travel here.
        extensions={"timeout": settings.timeouts},
    )
    request.read()  # its content, as with content=body (no copy: the one bytes object)
    return request


#: Methods whose requests httpx gives a ``Content-Length: 0`` when they have no body.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def open_upstream(
    state: ProxyState, scope: Scope, body: bytes, drop: frozenset[bytes] = frozenset()
) -> httpx.Response:
    """Send the client's request with ``body`` to vLLM (:func:`build_request`); return once
    vLLM's status and headers are in (body not read yet).

    Raises ``ProxyError`` (502/504) if vLLM cannot be reached. The caller must close the
    response (:func:`~vllm_hidden_state_proxy.transport.close_quietly`).
    """
    request = build_request(state.settings, scope, body, drop)
    try:
        return await state.transport.handle_async_request(request)
    except httpx.TransportError as exc:
        state.metrics.upstream_errors += 1
        raise transport_error(state.settings, exc) from exc


def transport_error(settings: ProxySettings, exc: httpx.HTTPError) -> ProxyError:
    """The error the client sees when the exchange with vLLM itself failed (no usable reply):
    in words only, since any client may see it; vLLM's address and the exception go to the
    proxy's log."""
    _log_failure(settings.upstream_url, exc)
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return vllm_timeout()
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return vllm_unreachable()
    return exchange_failed()


def broken_off(settings: ProxySettings, exc: httpx.HTTPError) -> ProxyError:
    """The error a flagged stream ends with when the exchange with vLLM breaks off after the
    response has started (vLLM crashed or reset the connection: 502; it stopped sending for
    the read timeout: 504)."""
    _log_failure(settings.upstream_url, exc)
    if isinstance(exc, httpx.TimeoutException):
        return stream_stalled()
    return stream_broke_off()


#: At most one log line per this many seconds about failed exchanges (a vLLM that is down
#: would otherwise write one per request), with the count of the ones not logged.
_LOG_INTERVAL = 10.0
_log_state = {"next": 0.0, "skipped": 0}


def _log_failure(url: str, exc: httpx.HTTPError) -> None:
    now = time.monotonic()
    if now < _log_state["next"]:
        _log_state["skipped"] += 1
        return
    skipped, _log_state["skipped"] = int(_log_state["skipped"]), 0
    _log_state["next"] = now + _LOG_INTERVAL
    more = f" ({skipped} more since the last line)" if skipped else ""
    log.warning("the exchange with vLLM at %s failed: %r%s", url, exc, more)
