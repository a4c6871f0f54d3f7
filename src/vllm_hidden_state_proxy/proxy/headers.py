"""Header filtering between client and vLLM (RFC 9110 §7.6.1 hop-by-hop headers)."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_hidden_state_proxy.proxy.types import RawHeaders

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)

#: Request headers never copied upstream: hop-by-hop, the ones httpx/the proxy set itself, and
#: ``Expect`` (the proxy has already read the whole body).
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in ``Connection`` (they are hop-by-hop too)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def upstream_request_headers(
    client_headers: Iterable[tuple[bytes, bytes]],
    body_length: int,
    drop: frozenset[bytes] = frozenset(),
) -> RawHeaders:
    """Client headers to send to vLLM: hop-by-hop removed, ``Host`` left for httpx to set.

    ``Content-Length`` is recomputed from the body actually sent (the flagged path rewrites it);
    it is sent whenever the body is non-empty or the client declared a body.
    """
    items = [(k.lower(), v) for k, v in client_headers]
    names = {k for k, _ in items}
    drop = _REQUEST_DROP | drop
    if b"connection" in names:  # once: per Connection header it was quadratic (a DoS)
        drop = drop | _connection_tokens(items)
    declared_body = b"content-length" in names or b"transfer-encoding" in names
    headers: RawHeaders = [(k, v) for k, v in items if k not in drop]
    if body_length or declared_body:
        headers.append((b"content-length", str(body_length).encode("ascii")))
    return headers


def downstream_response_headers(
    upstream_headers: Iterable[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()
) -> RawHeaders:
    """vLLM's response headers for the client: lower-cased names, hop-by-hop removed."""
    items = [(k.lower(), v) for k, v in upstream_headers]
    excluded = HOP_BY_HOP | drop
    if any(k == b"connection" for k, _ in items):
        excluded = excluded | _connection_tokens(items)
    return [(k, v) for k, v in items if k not in excluded]
