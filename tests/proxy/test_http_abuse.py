"""HTTP-level abuse (issue #7), through the real server: uvicorn with the production options
(``server_config``: uvloop, httptools), talked to over raw sockets (``raw_http.py``; the front
server's limits themselves: ``test_front_limits.py``).

The upstream is a fake vLLM behind ``httpx.MockTransport`` that publishes into a real ring, so
no second server is needed. uvicorn answers malformed HTTP itself (400, connection closed);
what the proxy answers itself is a 4xx in the OpenAI shape. Nothing here may produce a 5xx, an
"Exception in ASGI application", or a hang; the server keeps serving afterwards (the module's
server fixture checks that after the last test, whichever it is).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.proxy.fakes import settings_for
from tests.proxy.raw_http import (
    BODY,
    CHAT,
    FLAG,
    FLAGGED,
    LIMIT,
    Raw,
    Served,
    assert_vector_reply,
    chunked,
    exchange,
    request,
    serving,
)
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, XARGS_PREFIX

# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One uvicorn for the module. After the last test, whatever order they ran in: it still
    serves ordinary and flagged requests, and it never logged an error."""
    ring_dir = str(tmp_path_factory.mktemp("rings"))
    settings = settings_for(
        ring_dir, max_body_bytes=LIMIT, vector_timeout=2.0, port=0, log_level="warning"
    )
    with serving(settings) as served:
        yield served
        served.seen_before = len(served.upstream)
        check_ordinary_and_flagged_requests(served)
        assert served.errors.records == [], [r.getMessage() for r in served.errors.records]


@pytest.fixture
def served(server: Served) -> Iterator[Served]:
    """The module's server; after the test: no uvicorn error was logged."""
    server.seen_before = len(server.upstream)
    server.errors_before = len(server.errors.records)
    yield server
    new = server.errors.records[server.errors_before :]
    assert not new, [record.getMessage() for record in new]


# ---------------------------------------------------------------------------------------------
# baseline
# ---------------------------------------------------------------------------------------------


def check_ordinary_and_flagged_requests(served: Served) -> None:
    assert exchange(served.port, request(BODY)).status == 200
    assert_vector_reply(exchange(served.port, request(FLAGGED)), served)
    stream = FLAGGED.replace(b'"model"', b'"stream": true, "model"')
    reply = exchange(served.port, request(stream))
    assert reply.status == 200 and reply.header(b"content-type") == b"text/event-stream"
    first = json.loads(reply.body.split(b"\n\n")[0].removeprefix(b"data: "))
    assert "last_hidden_state" in first["kv_transfer_params"]


def test_ordinary_and_flagged_requests_are_served(served: Served) -> None:
    check_ordinary_and_flagged_requests(served)


# ---------------------------------------------------------------------------------------------
# malformed framing: uvicorn answers 400 and closes; nothing reaches vLLM
# ---------------------------------------------------------------------------------------------

_CL = b"Content-Length: %d\r\n" % len(FLAGGED)
MALFORMED = {
    "content-length-and-chunked": request(
        chunked(FLAGGED), headers=_CL + b"Transfer-Encoding: chunked\r\n", length=False
    ),
    "chunked-and-content-length": request(
        chunked(FLAGGED), headers=b"Transfer-Encoding: chunked\r\n" + _CL, length=False
    ),
    "two-content-lengths": request(FLAGGED, headers=b"Content-Length: 5\r\n"),
    "two-equal-content-lengths": request(FLAGGED, headers=_CL),
    "content-length-list": request(
        FLAGGED, headers=b"Content-Length: %d, %d\r\n" % (len(FLAGGED), len(FLAGGED)), length=False
    ),
    "negative-content-length": request(FLAGGED, headers=b"Content-Length: -1\r\n", length=False),
    "signed-content-length": request(
        FLAGGED, headers=b"Content-Length: +%d\r\n" % len(FLAGGED), length=False
    ),
    "content-length-overflow": request(
        FLAGGED, headers=b"Content-Length: " + b"9" * 30 + b"\r\n", length=False
    ),
    "chunked-not-last": request(
        chunked(FLAGGED), headers=b"Transfer-Encoding: chunked, identity\r\n", length=False
    ),
    "unknown-transfer-coding": request(
        FLAGGED, headers=b"Transfer-Encoding: xchunked\r\n", length=False
    ),
    "bad-chunk-size": request(
        b"zz\r\n" + FLAGGED + b"\r\n0\r\n\r\n",
        headers=b"Transfer-Encoding: chunked\r\n",
        length=False,
    ),
    "bare-lf": request(FLAGGED).replace(b"\r\n", b"\n"),
    "bare-cr-in-value": request(FLAGGED, headers=b"X-A: a\rb\r\n"),
    "nul-in-value": request(FLAGGED, headers=b"X-A: a\x00b\r\n"),
    "obsolete-line-folding": request(FLAGGED, headers=b"X-A: a\r\n b\r\n"),
    "space-before-colon": request(FLAGGED, headers=b"X-A : b\r\n"),
    "non-ascii-path": request(FLAGGED, path=b"/v1/chat/\xff\xfe"),
    "tls-client-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(100),
    "http2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(30),
}


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_http_is_refused_by_the_server(served: Served, data: bytes) -> None:
    raw = Raw(served.port).send(data)
    try:
        reply = raw.reply()
        assert reply is None or reply.status == 400, reply
        assert raw.closed()
    finally:
        raw.close()
    assert served.new_upstream == []


# ---------------------------------------------------------------------------------------------
# big heads: 431 from the front server (--max-head-size, 64 KiB by default), connection closed
# ---------------------------------------------------------------------------------------------


MANY_CONNECTION_HEADERS = b"".join(
    b"Connection: x-h%d\r\nX-H%d: v\r\n" % (i, i) for i in range(8000)
)


@pytest.mark.parametrize(
    "data",
    [
        request(FLAGGED, headers=b"X-Big: " + b"a" * 100_000 + b"\r\n"),
        request(FLAGGED, headers=b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))),
        request(FLAGGED, headers=MANY_CONNECTION_HEADERS),
        request(FLAGGED, path=CHAT + b"?" + b"a" * 500_000),
    ],
    ids=["one-100KB-header", "10k-headers", "8k-connection-headers", "url-500k"],
)
def test_huge_heads_are_431_and_reach_nothing(served: Served, data: bytes) -> None:
    raw = Raw(served.port).send(data)
    try:
        reply = raw.reply()
        assert reply is not None and reply.status == 431, reply
        assert raw.closed()
    finally:
        raw.close()
    assert served.new_upstream == []


def test_many_idle_connections_do_not_starve_a_request(served: Served) -> None:
    idle = [Raw(served.port).send(b"POST /v1/chat/completions HTTP/1.1\r\nHo") for _ in range(200)]
    try:
        assert exchange(served.port, request(BODY)).status == 200
    finally:
        for raw in idle:
            raw.close()


# ---------------------------------------------------------------------------------------------
# bodies over the limit: 413 in the OpenAI shape, from the proxy
# ---------------------------------------------------------------------------------------------

GENERATION_PATHS = [CHAT, b"/v1/completions", b"/v1/embeddings", b"/v1/responses"]


@pytest.mark.parametrize("path", GENERATION_PATHS, ids=lambda p: p.decode())
def test_declared_length_over_the_limit_is_413_before_the_body(served: Served, path: bytes) -> None:
    raw = Raw(served.port, timeout=5).send(
        b"POST " + path + b" HTTP/1.1\r\nHost: proxy\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1)
    )
    try:
        reply = raw.final_reply()  # no body sent: the proxy must not wait for it
    finally:
        raw.close()
    assert reply.status == 413
    assert str(LIMIT) in reply.openai_error()["message"]
    assert served.new_upstream == []


def test_expect_100_continue_over_the_limit_gets_413_not_100(served: Served) -> None:
    raw = Raw(served.port, timeout=5).send(
        request(
            b"",
            headers=b"Expect: 100-continue\r\nContent-Length: %d\r\n" % (LIMIT * 4),
            length=False,
        )
    )
    try:
        reply = raw.reply()
    finally:
        raw.close()
    assert reply is not None and reply.status == 413
    reply.openai_error()


@pytest.mark.parametrize("path", GENERATION_PATHS, ids=lambda p: p.decode())
def test_chunked_body_over_the_limit_is_413(served: Served, path: bytes) -> None:
    body = b'{"messages": "' + b"x" * LIMIT + b'", ' + FLAG + b"}"
    data = request(
        chunked(body, 8192), path=path, headers=b"Transfer-Encoding: chunked\r\n", length=False
    )
    reply = exchange(served.port, data)
    assert reply.status == 413
    reply.openai_error()
    assert served.new_upstream == []


def test_pipelined_requests_around_a_413_are_all_answered_in_order(served: Served) -> None:
    big = b"x" * (LIMIT + 10)
    data = (
        request(BODY)
        + request(big)
        + request(FLAGGED)
        + request(BODY, headers=b"Connection: close\r\n")
    )
    raw = Raw(served.port).send(data)
    try:
        statuses = [raw.final_reply().status for _ in range(4)]
        assert raw.closed()
    finally:
        raw.close()
    assert statuses == [200, 413, 200, 200]
    assert len(served.new_upstream) == 3


def test_content_length_smaller_than_the_body(served: Served) -> None:
    """The body is cut at the declared length (that request goes on as what it declared); the
    rest is parsed as the next request, which is garbage: 400 from uvicorn."""
    data = request(FLAGGED, headers=b"Content-Length: 10\r\n", length=False)
    raw = Raw(served.port).send(data)
    try:
        first = raw.final_reply()
        second = raw.reply()
    finally:
        raw.close()
    assert first.status < 500 and (second is None or second.status == 400)
    assert all(request.content == FLAGGED[:10] for request in served.new_upstream)


def test_content_length_larger_than_the_body_then_eof(served: Served) -> None:
    """The client gives up mid-body: no answer, no upstream request, no error."""
    raw = Raw(served.port, timeout=5).send(
        request(FLAGGED, headers=b"Content-Length: 5000\r\n", length=False)
    )
    raw.sock.shutdown(socket.SHUT_WR)
    try:
        assert raw.reply() is None  # the server saw the end of the connection
    finally:
        raw.close()
    after = exchange(served.port, request(BODY))  # and serves the next one
    assert after.status == 200
    assert [r.content for r in served.new_upstream] == [BODY]


# ---------------------------------------------------------------------------------------------
# bodies the proxy refuses: 400 in the OpenAI shape; vLLM sees nothing
# ---------------------------------------------------------------------------------------------

RESERVED = (
    b'"vllm_xargs": {"' + REQUEST_KEY_ENTRY.encode() + b'": "0123456789abcdef0123456789abcdef"}'
)
REFUSED = {
    "invalid-utf8": (CHAT, b'{"x": "\xff\xfe\xc0\xaf", ' + FLAG + b"}", None),
    "nesting-100k": (CHAT, b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b", " + FLAG + b"}", None),
    "nesting-1000": (CHAT, b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b", " + FLAG + b"}", None),
    "nesting-1000-flag-off": (
        b"/v1/completions",
        b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b', "kv_transfer_params": '
        b'{"return_last_hidden_state": false}}',
        None,
    ),
    "embeddings-messages-nesting-1000": (
        b"/v1/embeddings",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}",
        "messages",
    ),
    "reserved-key-chat": (CHAT, b'{"messages": [], ' + RESERVED + b"}", "vllm_xargs"),
    "reserved-key-flagged": (CHAT, b"{" + FLAG + b", " + RESERVED + b"}", "vllm_xargs"),
    "reserved-key-completions": (
        b"/v1/completions",
        b'{"prompt": "x", ' + RESERVED + b"}",
        "vllm_xargs",
    ),
    "reserved-key-other-path": (
        b"/v1/responses",
        b'{"input": "x", ' + RESERVED + b"}",
        "vllm_xargs",
    ),
    "reserved-key-utf16": (
        b"/v1/completions",
        ('{"prompt": "x", ' + RESERVED.decode() + "}").encode("utf-16"),
        "vllm_xargs",
    ),
    "reserved-prefix": (
        b"/v1/completions",
        b'{"prompt": "x", "vllm_xargs": {"' + XARGS_PREFIX.encode() + b'layers": [0]}}',
        "vllm_xargs",
    ),
    "layers-malformed": (
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": true, '
        b'"last_hidden_state_layers": "all"}}',
        "kv_transfer_params.last_hidden_state_layers",
    ),
    "reserved-key-escaped": (
        CHAT,
        b'{"vllm_xargs": {"hidden_state_proxy\\u005fkey": "00"}}',
        "vllm_xargs",
    ),
    "flag-not-bool": (
        CHAT,
        b'{"kv_transfer_params": {"return_last_hidden_state": "yes"}}',
        "kv_transfer_params.return_last_hidden_state",
    ),
}


@pytest.mark.parametrize(("path", "body", "param"), list(REFUSED.values()), ids=list(REFUSED))
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_refused_bodies_are_400_in_openai_shape(
    served: Served, path: bytes, body: bytes, param: str | None, framing: str
) -> None:
    if framing == "chunked":
        data = request(
            chunked(body, 4096), path=path, headers=b"Transfer-Encoding: chunked\r\n", length=False
        )
    else:
        data = request(body, path=path)
    reply = exchange(served.port, data)
    assert reply.status == 400, reply
    error = reply.openai_error()
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert served.new_upstream == []


def test_deep_unflagged_body_is_left_to_vllm(served: Served) -> None:
    """Without the flag the proxy does not parse the body: it goes to vLLM byte for byte."""
    body = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = exchange(served.port, request(body))
    assert reply.status == 400  # the fake vLLM's own answer (json.loads gives up)
    assert json.loads(reply.body)["error"]["message"] == "bad JSON"
    assert [r.content for r in served.new_upstream] == [body]


# ---------------------------------------------------------------------------------------------
# hop-by-hop headers
# ---------------------------------------------------------------------------------------------

HOP_HEADERS = (
    b"Connection: x-secret, keep-alive\r\n"
    b"Connection: X-Other\r\n"
    b"x-secret: 1\r\n"
    b"X-Other: 2\r\n"
    b"Keep-Alive: timeout=100\r\n"
    b"TE: trailers\r\n"
    b"Proxy-Authorization: Basic c2VjcmV0\r\n"
    b"Upgrade: h2c\r\n"
    b"X-Kept: 3\r\n"
)
HOP_NAMES = {
    b"connection",
    b"x-secret",
    b"x-other",
    b"keep-alive",
    b"te",
    b"proxy-authorization",
    b"upgrade",
    b"transfer-encoding",
}


@pytest.mark.parametrize("body", [BODY, FLAGGED], ids=["ordinary", "flagged"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_hop_by_hop_headers_do_not_reach_vllm(served: Served, body: bytes, framing: str) -> None:
    if framing == "chunked":
        data = request(
            chunked(body, 7), headers=HOP_HEADERS + b"Transfer-Encoding: chunked\r\n", length=False
        )
    else:
        data = request(body, headers=HOP_HEADERS)
    reply = exchange(served.port, data)
    assert reply.status == 200, reply
    (forwarded,) = served.new_upstream
    names = {k.lower() for k, _ in forwarded.headers.raw}
    assert not names & HOP_NAMES, names
    assert forwarded.headers["x-kept"] == "3"
    assert forwarded.headers["host"] == "vllm.test:8000"
    assert int(forwarded.headers["content-length"]) == len(forwarded.content)
    if body is BODY:
        assert forwarded.content == body


def test_hop_by_hop_headers_from_vllm_do_not_reach_the_client(served: Served) -> None:
    reply = exchange(served.port, request(b"", method=b"GET", path=b"/v1/hop-by-hop", length=False))
    assert reply.status == 200
    names = {k for k, _ in reply.headers}
    assert b"x-ok" in names
    assert not names & {b"x-up", b"keep-alive", b"proxy-authenticate"}, names


# ---------------------------------------------------------------------------------------------
# upgrades
# ---------------------------------------------------------------------------------------------


def test_websocket_handshake_is_refused(served: Served) -> None:
    """The proxy has no websocket route: uvicorn refuses the handshake (403)."""
    ws = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    ws += b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    reply = exchange(
        served.port, request(b"", method=b"GET", path=b"/v1/realtime", headers=ws, length=False)
    )
    assert 400 <= reply.status < 500
    assert served.new_upstream == []


def test_websocket_upgrade_with_a_body_is_answered(served: Served) -> None:
    """uvicorn's websockets protocol refuses it (400) and closes; it used to hang here (an
    xfail until uvicorn 0.55 and its websockets answered)."""
    ws = b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    ws += b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    raw = Raw(served.port, timeout=2).send(request(FLAGGED, headers=ws))
    try:
        reply = raw.reply()
        assert reply is None or 400 <= reply.status < 500, reply
        assert raw.closed()
    finally:
        raw.close()


def test_unsupported_upgrade_with_a_body(served: Served) -> None:
    """uvicorn drops the body of a request asking for an upgrade it does not support (h2c):
    the proxy sees an empty body, vLLM refuses it. Never a vector-less 200."""
    headers = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"
    reply = exchange(served.port, request(FLAGGED, headers=headers))
    assert reply.status < 500
    if reply.status == 200:
        assert_vector_reply(reply, served)
    for forwarded in served.new_upstream:
        assert b"return_last_hidden_state" not in forwarded.content


# ---------------------------------------------------------------------------------------------
# request targets: wherever a flagged request lands, never a 200 without its vector
# ---------------------------------------------------------------------------------------------

TARGETS = [
    b"POST http://evil.test/v1/chat/completions",  # absolute form: the host is ignored
    b"POST /v1/chat/%63ompletions",  # decoded the same way by the proxy and by vLLM
    b"POST /v1/chat/completions?stream=true",
    b"POST /v1/chat/completions#fragment",
    b"POST /v1/chat/completions/",
    b"POST /v1//chat/completions",
    b"POST /v1/chat/completions;x",
    b"POST /v1/chat/completions%2f",
    b"POST /v1/chat/completions%00",
    b"POST /V1/chat/completions",
    b"PUT /v1/chat/completions",
    b"GET /v1/chat/completions",
    b"PATCH /v1/embeddings",
    b"OPTIONS *",
    b"CONNECT vllm.test:8000",
]


@pytest.mark.parametrize("target", TARGETS, ids=[t.decode() for t in TARGETS])
def test_flagged_request_at_odd_targets(served: Served, target: bytes) -> None:
    method, path = target.split(b" ")
    reply = exchange(served.port, request(FLAGGED, method=method, path=path))
    assert reply.status < 500, reply
    if reply.status == 200:
        assert_vector_reply(reply, served)
    for forwarded in served.new_upstream:
        assert forwarded.url.host == "vllm.test"
        assert b"return_last_hidden_state" not in forwarded.content
