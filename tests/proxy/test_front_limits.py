"""The front server's limits (issue #25), through the real server over raw sockets: the size of
request heads and the time they take (``http_protocol.py``), the time a body takes and the
total of buffered bodies (``asgi.py``), the bound on connections (uvicorn's
``limit_concurrency``), also with ``--workers 2``.

Each server gets small limits. States are waited for (the server's connection set, the app's
body budget), never slept on; a timeout here is a deadline for something to happen, not a
measurement.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy.fakes import settings_for
from tests.proxy.raw_http import (
    BODY,
    FLAGGED,
    LIMIT,
    Raw,
    Served,
    assert_vector_reply,
    chunked,
    exchange,
    request,
    serving,
    wait_until,
)
from vllm_hidden_state_proxy.processes import free_port, offline_environment

#: Three bodies of the largest size fit at once.
BUDGET = 3 * LIMIT
HEAD = 4096
QUICK = 1.0
STALLED_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHo"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Slow clocks (nothing here times out by accident), a small head and body budget."""
    settings = settings_for(
        str(tmp_path_factory.mktemp("rings")),
        port=0,
        log_level="warning",
        max_body_bytes=LIMIT,
        max_head_bytes=HEAD,
        body_budget_bytes=BUDGET,
        head_timeout=60.0,
        body_timeout=60.0,
        vector_timeout=2.0,
    )
    with serving(settings) as served:
        yield served
        assert served.errors.records == [], [r.getMessage() for r in served.errors.records]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Heads and bodies must arrive within a second."""
    settings = settings_for(
        str(tmp_path_factory.mktemp("rings")),
        port=0,
        log_level="warning",
        head_timeout=QUICK,
        body_timeout=QUICK,
    )
    with serving(settings) as served:
        yield served
        assert served.errors.records == [], [r.getMessage() for r in served.errors.records]


@pytest.fixture
def served(server: Served) -> Served:
    server.seen_before = len(server.upstream)
    return server


def clients_held(served: Served, *ports: int) -> int:
    """How many of these client ports the server still holds a connection (a socket) for."""
    connections = list(served.userver.server_state.connections)
    held = {getattr(protocol, "client", None) for protocol in connections}
    return sum(("127.0.0.1", port) in held for port in ports)


def port_of(raw: Raw) -> int:
    port: int = raw.sock.getsockname()[1]
    return port


# ---------------------------------------------------------------------------------------------
# heads: size
# ---------------------------------------------------------------------------------------------


def send_endlessly(sock: socket.socket, deadline: float) -> bytes | None:
    """Send one header that never ends until the server stops it (or the deadline); what the
    server answered, or ``None`` if it did not stop it."""
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Endless: ")
    piece = b"a" * 16384
    try:
        while time.monotonic() < deadline:
            sock.sendall(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    else:
        return None
    try:
        return sock.recv(1 << 16)
    except ConnectionResetError:  # the answer was lost to the reset: the cut itself counts
        return b""


def test_stalled_heads_and_an_endless_header_leave_a_flagged_request_working(
    served: Served,
) -> None:
    stalled = [Raw(served.port).send(STALLED_HEAD) for _ in range(256)]
    endless = Raw(served.port)
    try:
        stalled_ports = [port_of(raw) for raw in stalled]
        wait_until(lambda: clients_held(served, *stalled_ports) == 256, "all 256 are accepted")
        answered: list[bytes | None] = []
        sender = threading.Thread(
            target=lambda: answered.append(send_endlessly(endless.sock, time.monotonic() + 30))
        )
        sender.start()
        assert_vector_reply(exchange(served.port, request(FLAGGED)), served)
        sender.join(60)
        assert answered and answered[0] is not None, "the endless header was never cut off"
        assert answered[0] == b"" or answered[0].startswith(b"HTTP/1.1 431 "), answered
        # Out of uvicorn's connection set: connection_lost ran, the socket (its fd) is closed.
        wait_until(lambda: clients_held(served, port_of(endless)) == 0, "its socket is closed")
        assert clients_held(served, *stalled_ports) == 256  # the slow clock: all still there
    finally:
        endless.close()
        for raw in stalled:
            raw.close()
    wait_until(lambda: clients_held(served, *stalled_ports) == 0, "the stalled ones are gone")


def test_a_head_just_over_the_limit_in_one_piece_is_431(served: Served) -> None:
    pad = b"X-Pad: " + b"a" * HEAD + b"\r\n"
    raw = Raw(served.port).send(request(FLAGGED, headers=pad))
    try:
        reply = raw.final_reply()
        assert reply.status == 431
        assert raw.closed()
    finally:
        raw.close()
    assert served.new_upstream == []
    assert exchange(served.port, request(BODY)).status == 200  # just under: served


# ---------------------------------------------------------------------------------------------
# heads and bodies: time
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent", [b"", STALLED_HEAD, b"GET /health HTTP/1.1\r\n"], ids=["nothing", "half", "no-end"]
)
def test_a_head_that_never_completes_is_closed_after_the_head_timeout(
    quick: Served, sent: bytes
) -> None:
    raw = Raw(quick.port).send(sent)
    port = port_of(raw)
    try:
        reply = raw.reply()  # waits for the server (Raw's own timeout is 10 s)
        assert reply is not None and reply.status == 408, reply
        assert raw.closed()
        wait_until(lambda: clients_held(quick, port) == 0, "its socket is closed")
    finally:
        raw.close()


def test_a_head_trickling_in_is_closed_after_the_head_timeout(quick: Served) -> None:
    """A byte now and then does not keep the head's clock from running."""
    raw = Raw(quick.port)
    wait_until(lambda: clients_held(quick, port_of(raw)) == 1, "the connection is accepted")
    deadline = time.monotonic() + 10 * QUICK
    try:
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: " + b"a" * 10_000:
            if clients_held(quick, port_of(raw)) == 0 or time.monotonic() > deadline:
                break
            try:
                raw.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(QUICK / 10)  # the client's pace, not a wait for the server
        assert clients_held(quick, port_of(raw)) == 0, "the trickling head is still served"
    finally:
        raw.close()


def test_the_next_head_on_a_kept_alive_connection_has_its_own_clock(quick: Served) -> None:
    raw = Raw(quick.port).send(request(BODY))
    try:
        assert raw.final_reply().status == 200
        raw.send(STALLED_HEAD)
        reply = raw.reply()
        assert reply is not None and reply.status == 408
        assert raw.closed()
    finally:
        raw.close()


def test_a_slow_body_is_cut_after_the_body_timeout(quick: Served) -> None:
    quick.seen_before = len(quick.upstream)
    head = request(BODY, headers=b"Content-Length: %d\r\n" % (len(BODY) + 10), length=False)
    raw = Raw(quick.port).send(head[: -len(BODY)] + BODY[:10])  # the head and 10 bytes
    try:
        reply = raw.final_reply()
        assert reply.status == 408
        assert reply.openai_error()["type"] == "request_timeout"
        assert raw.closed()
    finally:
        raw.close()
    assert quick.new_upstream == []
    wait_until(lambda: quick.state.body_budget.held == 0, "its share of the budget is back")


def test_a_body_trickling_in_is_cut_after_the_body_timeout(quick: Served) -> None:
    """All of the body within the timeout, not each chunk: a byte now and then is cut too."""
    quick.seen_before = len(quick.upstream)
    raw = Raw(quick.port).send(
        request(b"", headers=b"Transfer-Encoding: chunked\r\n", length=False)
    )
    wait_until(lambda: clients_held(quick, port_of(raw)) == 1, "the connection is accepted")
    deadline = time.monotonic() + 10 * QUICK
    try:
        while clients_held(quick, port_of(raw)) and time.monotonic() < deadline:
            try:
                raw.send(b"1\r\n \r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(QUICK / 10)  # the client's pace, not a wait for the server
        wait_until(lambda: clients_held(quick, port_of(raw)) == 0, "the slow client is cut off")
    finally:
        raw.close()
    assert quick.new_upstream == []


# ---------------------------------------------------------------------------------------------
# bodies: the total budget
# ---------------------------------------------------------------------------------------------


def padded(size: int) -> bytes:
    """An ordinary chat body of exactly ``size`` bytes (vLLM's fake answers it 200)."""
    body = BODY[:-1] + b', "pad": ""}'
    return body[:-2] + b"x" * (size - len(body)) + b'"}'


def test_the_body_budget_refuses_the_request_that_would_exceed_it(served: Served) -> None:
    big = padded(LIMIT)
    assert len(big) == LIMIT
    part = LIMIT * 3 // 4  # sent of each held body: three leave room for less than one more
    holders = [Raw(served.port).send(request(big)[: -LIMIT + part]) for _ in range(3)]
    try:
        wait_until(lambda: served.state.body_budget.held == 3 * part, "three bodies are held")
        refused = exchange(served.port, request(big))  # declared: refused before its body
        assert refused.status == 503, refused
        error = refused.openai_error()
        assert error["type"] == "service_unavailable" and "--body-budget" in error["message"]
        chunked_big = request(
            chunked(big, 8192), headers=b"Transfer-Encoding: chunked\r\n", length=False
        )
        assert exchange(served.port, chunked_big).status == 503  # refused as it grows
        assert exchange(served.port, request(BODY)).status == 200  # a small one fits
        assert_vector_reply(exchange(served.port, request(FLAGGED)), served)
        assert served.state.body_budget.held == 3 * part  # the refused gave theirs back
        holders.pop().close()  # one holder leaves: room for one more body
        wait_until(lambda: served.state.body_budget.held == 2 * part, "its part is back")
        holders[0].send(request(big)[-LIMIT + part :])
        assert holders[0].final_reply().status == 200  # the rest of a held body fits now
    finally:
        for raw in holders:
            raw.close()
    wait_until(lambda: served.state.body_budget.held == 0, "the budget is given back")
    assert exchange(served.port, request(big)).status == 200


# ---------------------------------------------------------------------------------------------
# connections
# ---------------------------------------------------------------------------------------------


def test_requests_beyond_the_connection_bound_get_503(tmp_path: Path) -> None:
    settings = settings_for(
        str(tmp_path / "rings"), port=0, log_level="error", max_client_connections=4
    )
    with serving(settings) as served:
        held = [Raw(served.port).send(STALLED_HEAD) for _ in range(3)]
        try:
            ports = [port_of(raw) for raw in held]
            wait_until(lambda: clients_held(served, *ports) == 3, "three connections are held")
            refused = exchange(served.port, request(BODY))  # the fourth, its own included
            assert refused.status == 503, refused
            held.pop().close()
            wait_until(lambda: len(served.userver.server_state.connections) < 3, "one is gone")
            assert exchange(served.port, request(BODY)).status == 200
        finally:
            for raw in held:
                raw.close()
        assert len(served.upstream) == 1  # the refused request never reached vLLM


# ---------------------------------------------------------------------------------------------
# the limits in every worker of --workers 2
# ---------------------------------------------------------------------------------------------


def test_the_head_limits_hold_in_every_worker(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "vllm_hidden_state_proxy.cli", "proxy"]
    command += ["--upstream", "http://127.0.0.1:9", "--ring-dir", str(tmp_path / "rings")]
    command += ["--port", str(port), "--workers", "2", "--log-level", "warning"]
    command += ["--max-head-size", str(HEAD), "--head-timeout", str(QUICK)]
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=offline_environment()
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # up when a request head gets an answer
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if exchange(port, request(b"", method=b"GET", path=b"/metrics", length=False)):
                    break
            except (ConnectionError, AssertionError):
                time.sleep(0.1)
        # Many connections, so that both workers get some (the kernel spreads them).
        big = request(FLAGGED, headers=b"X-Pad: " + b"a" * 2 * HEAD + b"\r\n")
        silent = [Raw(port) for _ in range(8)]
        try:
            for _ in range(8):
                assert exchange(port, big).status == 431
            for raw in silent:
                reply = raw.reply()
                assert reply is not None and reply.status == 408
        finally:
            for raw in silent:
                raw.close()
    finally:
        process.terminate()
        process.wait(30)
