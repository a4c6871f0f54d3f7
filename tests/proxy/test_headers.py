"""Header filtering between client and vLLM (proxy/headers.py): hop-by-hop headers (RFC 9110
7.6.1), the ones named in Connection, and Content-Length recomputed."""

from __future__ import annotations

import pytest

from vllm_hidden_state_proxy.proxy import headers
from vllm_hidden_state_proxy.proxy.headers import (
    HOP_BY_HOP,
    downstream_response_headers,
    upstream_request_headers,
)

CLIENT = [
    (b"Authorization", b"Bearer k"),
    (b"Host", b"proxy"),
    (b"Content-Length", b"999"),
    (b"Expect", b"100-continue"),
    (b"Connection", b"x-hop, Keep-Alive"),
    (b"X-Hop", b"drop me"),
    (b"Keep-Alive", b"timeout=1"),
    (b"TE", b"trailers"),
    (b"Upgrade", b"h2c"),
    (b"Proxy-Authorization", b"Basic x"),
    (b"X-Kept", b"1"),
    (b"X-Kept", b"2"),
]


def test_upstream_headers_drop_hop_by_hop_and_recompute_the_length() -> None:
    assert upstream_request_headers(CLIENT, 17) == [
        (b"authorization", b"Bearer k"),
        (b"x-kept", b"1"),
        (b"x-kept", b"2"),
        (b"content-length", b"17"),
    ]


@pytest.mark.parametrize(
    ("client", "length", "expected"),
    [
        ([], 0, []),  # a GET: no length invented
        ([], 3, [(b"content-length", b"3")]),
        ([(b"content-length", b"0")], 0, [(b"content-length", b"0")]),
        ([(b"transfer-encoding", b"chunked")], 0, [(b"content-length", b"0")]),
    ],
)
def test_content_length_whenever_there_is_or_was_a_body(
    client: list[tuple[bytes, bytes]], length: int, expected: list[tuple[bytes, bytes]]
) -> None:
    assert upstream_request_headers(client, length) == expected


def test_extra_names_can_be_dropped() -> None:
    kept = upstream_request_headers(CLIENT, 0, frozenset({b"authorization", b"x-kept"}))
    assert kept == [(b"content-length", b"0")]


def test_downstream_headers_drop_hop_by_hop() -> None:
    upstream = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"x-up"),
        (b"X-Up", b"1"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
        (b"Content-Length", b"5"),
    ]
    assert downstream_response_headers(upstream) == [
        (b"content-type", b"application/json"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"content-length", b"5"),
    ]
    assert downstream_response_headers(upstream, drop=frozenset({b"content-length"}))[-1] == (
        b"set-cookie",
        b"b=2",
    )


def test_hop_by_hop_names() -> None:
    assert {b"connection", b"keep-alive", b"te", b"transfer-encoding", b"upgrade"} <= HOP_BY_HOP


def test_many_connection_headers_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the Connection tokens were recomputed per Connection header, over all
    headers: 8,000 of them (260 KB) blocked the event loop for ~40 s. Counted, not timed."""
    calls = 0
    real = headers._connection_tokens

    def counting(items: object) -> frozenset[bytes]:
        nonlocal calls
        calls += 1
        return real(items)  # type: ignore[arg-type]

    monkeypatch.setattr(headers, "_connection_tokens", counting)
    many = []
    for i in range(20_000):
        many += [(b"connection", b"x-h%d" % i), (b"x-h%d" % i, b"v")]
    assert upstream_request_headers([*many, (b"x-kept", b"1")], 0) == [(b"x-kept", b"1")]
    assert downstream_response_headers([*many, (b"x-kept", b"1")]) == [(b"x-kept", b"1")]
    assert calls == 2
