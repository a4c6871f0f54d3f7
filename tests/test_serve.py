"""``hidden-state-proxy serve`` supervision, with tiny fake servers instead of vLLM and the proxy.

Each test runs ``serve`` as a real subprocess (signals, process groups and exit statuses are the
point) through a runner script that swaps ``vllm_command``/``proxy_command`` for a fake child that
answers ``/health``. The fakes write their pids to a directory so the tests can check that nothing
is left running. Every ``serve`` also gets an unreachable ``http_proxy`` in its environment: the
health probes must ignore it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_hidden_state_proxy import serve

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl"),
    pytest.mark.timeout(60),
]

FAKE_CHILD = r"""
import http.server, os, signal, sys, time
from pathlib import Path

role, port, pid_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
mode = os.environ.get("FAKE_" + role.upper(), "")
signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
signal.signal(signal.SIGUSR2, lambda *_: os._exit(0))
if mode == "slow-stop":
    def stop_slowly(*_):
        time.sleep(2)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop_slowly)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode == "unhealthy" else 200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
(pid_dir / f".{role}").write_text(str(os.getpid()))
(pid_dir / f".{role}").rename(pid_dir / role)  # atomic: the test never reads half a pid
server.serve_forever()
"""

RUNNER = r"""
import sys
from vllm_hidden_state_proxy import serve
from vllm_hidden_state_proxy.cli import main

child, pid_dir = sys.argv[1], sys.argv[2]
serve.PROXY_STARTUP_TIMEOUT = 2.0
serve.vllm_command = lambda model, port, extra: [
    sys.executable, child, "vllm", str(port), pid_dir
]
serve.proxy_command = lambda args, upstream, ring_dir: [
    sys.executable, child, "proxy", str(args.port), pid_dir
]
sys.exit(main(["serve", "fake-model", *sys.argv[3:]]))
"""

UNREACHABLE_PROXY = "http://127.0.0.1:9"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie waiting for a parent that may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


class Serve:
    """``serve`` with fake children, its stderr collected line by line."""

    def __init__(self, tmp_path: Path, *options: str, **fake_modes: str) -> None:
        (tmp_path / "child.py").write_text(FAKE_CHILD)
        (tmp_path / "runner.py").write_text(RUNNER)
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.port, self.vllm_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
        env.update(http_proxy=UNREACHABLE_PROXY, HTTP_PROXY=UNREACHABLE_PROXY)
        env.update({f"FAKE_{role.upper()}": mode for role, mode in fake_modes.items()})
        runner = [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "child.py")]
        ports = ["--port", str(self.port), "--vllm-port", str(self.vllm_port)]
        self.process = subprocess.Popen(
            [*runner, str(self.pid_dir), *ports, *options],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 10.0) -> None:
        if not wait_until(lambda: text in self.output, timeout):
            pytest.fail(f"{text!r} not printed within {timeout} s; stderr:\n{self.output}")

    def pid(self, role: str) -> int:
        path = self.pid_dir / role
        assert wait_until(path.exists, 10.0), f"no {role} started; stderr:\n{self.output}"
        return int(path.read_text())

    def ready(self) -> tuple[int, int]:
        self.wait_for(f"ready: OpenAI-compatible API at http://127.0.0.1:{self.port}/v1")
        return self.pid("vllm"), self.pid("proxy")

    def wait(self, timeout: float = 15.0) -> int:
        status = self.process.wait(timeout)
        self._reader.join(5)
        return status

    def ring_dir(self) -> Path:
        match = re.search(r"\(ring directory (\S+)\)", self.output)
        assert match, self.output
        return Path(match[1])

    def close(self) -> None:
        """Whatever a failed test left behind."""
        self.process.kill()
        self.process.wait()
        for path in self.pid_dir.iterdir():
            pid = int(path.read_text())
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        match = re.search(r"\(ring directory (\S+)\)", self.output)
        if match:  # this serve's own directory (or one under tmp_path)
            shutil.rmtree(match[1], ignore_errors=True)


Starter = Callable[..., Serve]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Starter]:
    started: list[Serve] = []

    def starter(*options: str, **fake_modes: str) -> Serve:
        started.append(Serve(tmp_path, *options, **fake_modes))
        return started[-1]

    yield starter
    for server in started:
        server.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_both_children_and_exits_0(start: Starter, signum: int) -> None:
    server: Serve = start()
    vllm, proxy = server.ready()
    ring_dir = server.ring_dir()
    assert ring_dir.name.startswith(serve.RING_DIR_PREFIX) and ring_dir.is_dir()
    assert alive(vllm) and alive(proxy)
    server.process.send_signal(signum)
    assert server.wait() == 0, server.output
    assert not alive(vllm) and not alive(proxy)
    assert not ring_dir.exists()
    assert f"{signal.Signals(signum).name}: stopping" in server.output


def test_second_ctrl_c_during_shutdown_leaves_nothing_behind(start: Starter) -> None:
    server: Serve = start(proxy="slow-stop")  # the proxy takes 2 s to stop, vLLM waits behind it
    vllm, proxy = server.ready()
    server.process.send_signal(signal.SIGINT)
    server.wait_for("SIGINT: stopping")
    time.sleep(0.3)
    server.process.send_signal(signal.SIGINT)
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output
    assert "Traceback" not in server.output
    assert not alive(vllm) and not alive(proxy)


def test_ctrl_c_while_vllm_loads(start: Starter) -> None:
    server: Serve = start(vllm="unhealthy")
    vllm = server.pid("vllm")
    server.process.send_signal(signal.SIGINT)
    assert server.wait() == 0, server.output
    assert not alive(vllm)
    assert not (server.pid_dir / "proxy").exists()


@pytest.mark.parametrize(
    ("role", "signum", "status", "message"),
    [
        ("vllm", signal.SIGUSR1, 3, "vLLM exited with status 3"),
        ("proxy", signal.SIGUSR2, 1, "the proxy exited with status 0"),
        ("vllm", signal.SIGKILL, 137, "vLLM was killed by SIGKILL"),
    ],
)
def test_a_child_ending_stops_the_other(
    start: Starter, role: str, signum: int, status: int, message: str
) -> None:
    server: Serve = start()
    pids = dict(zip(("vllm", "proxy"), server.ready(), strict=True))
    os.kill(pids[role], signum)
    assert server.wait() == status, server.output
    assert message in server.output
    assert not any(alive(pid) for pid in pids.values())


@pytest.mark.parametrize("option", ["--port", "--vllm-port"])
def test_taken_port_fails_at_once(start: Starter, option: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = str(holder.getsockname()[1])
        began = time.monotonic()
        server: Serve = start(option, taken)  # the last --port/--vllm-port wins
        assert server.wait(timeout=10) != 0
    assert time.monotonic() - began < 5
    assert f"port {taken} on 127.0.0.1 is not available" in server.output
    assert f"choose another port with {option}\n" in server.output
    assert not (server.pid_dir / "vllm").exists()


def test_proxy_that_never_gets_healthy_is_given_up_on(start: Starter) -> None:
    server: Serve = start(proxy="unhealthy")  # the runner sets PROXY_STARTUP_TIMEOUT = 2
    vllm, proxy = server.pid("vllm"), server.pid("proxy")
    assert server.wait() == 1, server.output
    assert "the proxy was not healthy after 2 s; giving up" in server.output
    assert not alive(vllm) and not alive(proxy)


def test_sigkill_of_serve_takes_the_children_down(start: Starter, tmp_path: Path) -> None:
    server: Serve = start("--ring-dir", str(tmp_path / "ring"))  # a hard kill leaves the dir
    vllm, proxy = server.ready()
    server.process.kill()
    server.wait()
    assert wait_until(lambda: not alive(vllm) and not alive(proxy), 5.0)


def test_exit_status() -> None:
    assert serve.exit_status(-signal.SIGKILL) == 137
    assert serve.exit_status(-signal.SIGTERM) == 143
    assert serve.exit_status(0) == 1
    assert serve.exit_status(3) == 3


PROBES = r"""
import http.server, pathlib, sys, threading
from vllm_hidden_state_proxy import demo, serve

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

class Running:
    returncode = None

    def poll(self):
        return None

server = http.server.HTTPServer(("127.0.0.1", 0), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}/health"
assert serve.healthy(url), "serve's probe went through the proxy"
demo._wait_ready(url, Running(), timeout=3, log=pathlib.Path("unused.log"))
print("both probes reached the server")
"""


def test_health_probes_ignore_environment_proxy() -> None:
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update(http_proxy=UNREACHABLE_PROXY, HTTP_PROXY=UNREACHABLE_PROXY)
    done = subprocess.run(
        [sys.executable, "-c", PROBES], env=env, capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    assert "both probes reached the server" in done.stdout
