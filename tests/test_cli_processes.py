"""``serve`` and ``proxy`` as real processes, without vLLM (issue #39): the host they listen on
by default and with a key, ``serve``'s refusal to listen beyond loopback without one, and the
proxy's drain on SIGTERM. The proxy runs in front of a tiny stand-in for vLLM (or of nothing:
``--upstream http://127.0.0.1:1``); each test waits for states (a line logged, an answer, an
exit), never a fixed time."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from vllm_hidden_state_proxy.processes import free_port, wait_until_healthy
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, VLLM_API_KEY_ENV

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp"),
    pytest.mark.timeout(60),
]

CLI = [sys.executable, "-m", "vllm_hidden_state_proxy.cli"]


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, VLLM_API_KEY_ENV)}
    env.update(values, NO_PROXY="*", no_proxy="*")
    return env


class Proxy:
    """``hidden-state-proxy proxy`` in a process of its own, its stderr collected."""

    def __init__(self, *options: str, **environ: str) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [*CLI, "proxy", f"--port={self.port}", "--ring-dir=/nonexistent", *options],
            stderr=subprocess.PIPE,
            text=True,
            env=environment(**environ),
        )
        self.lines: list[str] = []
        self.logged = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until_healthy(self.url + "/health", None, 30.0, status=None, interval=0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self.logged:
                self.lines.append(line)
                self.logged.notify_all()

    def wait_for(self, text: str, timeout: float = 20.0) -> None:
        with self.logged:
            if not self.logged.wait_for(lambda: text in "".join(self.lines), timeout):
                pytest.fail(f"{text!r} not logged; stderr:\n{''.join(self.lines)}")

    def listening_addresses(self) -> set[str]:
        """The local addresses its listening TCP sockets are bound to (from /proc/net/tcp*)."""
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in Path(table).read_text().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, port = local.split(":")
                if state == "0A" and int(port, 16) == self.port:
                    found.add(address)
        return found

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(10)
        if self.process.stderr is not None:
            self.process.stderr.close()


@pytest.fixture
def proxies() -> Iterator[list[Proxy]]:
    started: list[Proxy] = []
    yield started
    for proxy in started:
        proxy.close()


def test_serve_on_all_interfaces_without_a_key_stops_before_vllm() -> None:
    finished = subprocess.run(
        [*CLI, "serve", "no/such-model", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=60,
    )
    assert finished.returncode == 2
    message = " ".join(finished.stderr.split())
    assert "--host 0.0.0.0 listens beyond this machine, but the proxy has no API key" in message
    assert VLLM_API_KEY_ENV in message and "--allow-unauthenticated" in message
    assert "starting vLLM" not in message


def test_the_proxy_with_vllms_key_listens_everywhere_and_wants_it(proxies: list[Proxy]) -> None:
    proxy = Proxy("--upstream=http://127.0.0.1:1", **{VLLM_API_KEY_ENV: "k"})
    proxies.append(proxy)
    assert proxy.listening_addresses() == {"00000000"}  # 0.0.0.0
    assert httpx.get(proxy.url + "/v1/models").status_code == 401
    keyed = httpx.get(proxy.url + "/v1/models", headers={"authorization": "Bearer k"})
    assert keyed.status_code == 502  # past the key; vLLM is not there
    assert "WARNING" not in "".join(proxy.lines)


def test_the_proxy_without_a_key_listens_on_loopback(proxies: list[Proxy]) -> None:
    proxy = Proxy("--upstream=http://127.0.0.1:1")
    proxies.append(proxy)
    assert proxy.listening_addresses() == {"0100007F"}  # 127.0.0.1


def test_the_proxy_alone_on_all_interfaces_without_a_key_warns(proxies: list[Proxy]) -> None:
    proxy = Proxy("--upstream=http://127.0.0.1:1", "--host=0.0.0.0")
    proxies.append(proxy)
    assert proxy.listening_addresses() == {"00000000"}
    assert "WARNING: --host 0.0.0.0 listens beyond this machine" in "".join(proxy.lines)


class _SlowVLLM(http.server.ThreadingHTTPServer):
    """Answers /health at once and /v1/models once ``release`` is set."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _SlowHandler)


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    server: _SlowVLLM

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.server.arrived.set()
            self.server.release.wait(30)
        body = b'{"object": "list", "data": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the proxy cut the request and closed
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("drain", ["20", "0.2"])
def test_sigterm_lets_requests_in_flight_finish_within_the_drain_time(
    proxies: list[Proxy], drain: str
) -> None:
    vllm = _SlowVLLM()
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    try:
        upstream = f"--upstream=http://127.0.0.1:{vllm.server_address[1]}"
        proxy = Proxy(upstream, f"--drain-timeout={drain}")
        proxies.append(proxy)
        answers: list[int | str] = []

        def ask() -> None:
            try:
                answers.append(httpx.get(proxy.url + "/v1/models", timeout=30).status_code)
            except httpx.HTTPError as error:
                answers.append(type(error).__name__)

        asking = threading.Thread(target=ask)
        asking.start()
        assert vllm.arrived.wait(20)
        proxy.process.send_signal(signal.SIGTERM)
        if drain == "20":  # the request is let finish: vLLM answers while the proxy drains
            proxy.wait_for("Waiting for connections to close")
            vllm.release.set()
        else:  # cut after 0.2 s, before vLLM answers
            proxy.wait_for("timeout graceful shutdown exceeded")
        # uvicorn raises the signal again once it has shut down cleanly.
        assert proxy.process.wait(20) == -signal.SIGTERM
        vllm.release.set()
        asking.join(20)
        # Cut before its answer began: uvicorn's 500.
        assert answers == ([200] if drain == "20" else [500]), proxy.lines
    finally:
        vllm.release.set()
        vllm.shutdown()
        vllm.server_close()
