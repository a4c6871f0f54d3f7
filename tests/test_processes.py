"""Process helpers shared by serve, the demo, the bench and the tests (processes.py)."""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.processes import (
    VLLM_LOOPBACK,
    HealthTimeout,
    NotHealthy,
    ServerExited,
    WaitStopped,
    ephemeral_ports,
    free_port,
    healthy,
    http_status,
    log_tail,
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
    vllm_command,
    wait_until_healthy,
)

UNREACHABLE_PROXY = "http://127.0.0.1:9"


def test_vllm_command() -> None:
    assert vllm_command("org/model", 8001, ["--dtype", "float16"]) == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "org/model",
        "--host",
        VLLM_LOOPBACK,
        "--port",
        "8001",
        "--dtype",
        "float16",
    ]
    assert vllm_command("m", 1, [], host="0.0.0.0")[6] == "0.0.0.0"
    # On a Unix socket vLLM binds no TCP port: neither --host nor --port.
    assert vllm_command("m", None, ["--x"], uds="/run/d/vllm.sock")[3:] == [
        "--model",
        "m",
        "--uds",
        "/run/d/vllm.sock",
        "--x",
    ]
    with pytest.raises(ValueError):
        vllm_command("m", None, [])


def test_http_status_over_a_unix_socket(tmp_path: Path) -> None:
    import http.server
    import socketserver
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = self.path.encode()
            self.send_response(404 if self.path.startswith("/missing") else 200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    path = str(tmp_path / "s.sock")
    assert http_status("http://localhost/health", uds=path) is None  # nothing listens yet
    server = socketserver.UnixStreamServer(path, Answer)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        assert http_status("http://localhost/health?x=1", uds=path) == (200, b"/health?x=1")
        assert http_status("http://ignored/missing", uds=path) == (404, b"/missing")
        assert healthy("http://localhost/health", uds=path)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_offline_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    environment = offline_environment()
    assert environment["VLLM_CPU_KVCACHE_SPACE"] == "8"  # a setting of one's own is kept
    assert environment["HF_HUB_OFFLINE"] == environment["TRANSFORMERS_OFFLINE"] == "1"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert offline_environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range() -> None:
    """Below the range vLLM's own ports (binds to port 0) come from, so they cannot take one."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < ephemeral_ports()[0] for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert log_tail(log, 2) == "line 98\nline 99"
    assert log_tail(tmp_path / "missing") == "(no log)"


PROBES = r"""
import http.server, subprocess, sys, threading
from vllm_hidden_state_proxy.processes import healthy, wait_until_healthy

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}/health"
assert healthy(url), "the probe went through the proxy"
running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                           stdin=subprocess.PIPE)
wait_until_healthy(url, running, timeout=30)
running.stdin.close()
running.wait()
print("both probes reached the server")
"""


def test_health_probes_ignore_an_http_proxy_in_the_environment() -> None:
    """serve, the demo and the bench probe their own children: never through a proxy."""
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update(http_proxy=UNREACHABLE_PROXY, HTTP_PROXY=UNREACHABLE_PROXY)
    paths = [str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    done = subprocess.run(
        [sys.executable, "-c", PROBES], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "both probes reached the server" in done.stdout


def test_waiting_for_health_ends_when_the_server_exits() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(NotHealthy, match="exited with status 3"):
            wait_until_healthy(f"http://127.0.0.1:{free_port()}/health", exited, timeout=3600)
    finally:
        exited.wait()


@contextlib.contextmanager
def answering(statuses: list[int]) -> Iterator[tuple[str, list[int]]]:
    """A local server answering GET with ``statuses`` in turn (the last one from then on); the
    URL, and the statuses it answered so far."""
    answered: list[int] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = statuses[min(len(answered), len(statuses) - 1)]
            answered.append(status)
            body = f"answer {len(answered)}".encode()
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health", answered
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_waiting_for_health_polls_until_200_and_returns_the_answer() -> None:
    with answering([503, 503, 200]) as (url, answered):
        assert wait_until_healthy(url, None, 30, interval=0.01) == (200, b"answer 3")
    assert answered == [503, 503, 200]


def test_waiting_for_any_answer_or_for_one_status() -> None:
    with answering([503, 200]) as (url, answered):
        assert wait_until_healthy(url, None, 30, status=None) == (503, b"answer 1")
    with answering([200, 200, 503]) as (url, answered):
        assert wait_until_healthy(url, None, 30, status=503, interval=0.01)[0] == 503
    assert answered == [200, 200, 503]


def test_waiting_for_health_stops_when_told_and_asks_before_each_probe() -> None:
    asked: list[float] = []

    def stop() -> bool:
        asked.append(time.monotonic())
        return len(asked) == 3

    with answering([503]) as (url, answered), pytest.raises(WaitStopped):
        wait_until_healthy(url, None, 30, interval=0.01, stop=stop)
    assert len(asked) == 3 and len(answered) == 2
    # Even a healthy server: the caller said stop.
    with answering([200]) as (url, answered), pytest.raises(WaitStopped):
        wait_until_healthy(url, None, 30, stop=lambda: True)
    assert answered == []


def test_waiting_for_health_gives_up_at_the_deadline_and_reports_progress() -> None:
    waited: list[float] = []
    url = f"http://127.0.0.1:{free_port()}/health"
    with pytest.raises(HealthTimeout, match=f"{url} was not healthy after 0 s"):
        wait_until_healthy(
            url, None, 0.2, interval=0.01, progress=waited.append, progress_every=0.05
        )
    assert waited and waited == sorted(waited) and all(0.05 <= w <= 0.2 for w in waited)


def test_a_server_that_exits_is_named_with_its_status() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    exited.wait()
    with pytest.raises(ServerExited) as raised:
        wait_until_healthy(f"http://127.0.0.1:{free_port()}/health", exited, timeout=3600)
    assert raised.value.returncode == 4 and isinstance(raised.value, NotHealthy)


SLEEPER = "import signal, sys; {setup}; print('ready', flush=True); sys.stdin.read()"


def start_sleeper(setup: str = "pass") -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", SLEEPER.format(setup=setup)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def test_stop_process_group_terminates_then_kills() -> None:
    said: list[str] = []
    polite = start_sleeper()
    stubborn = start_sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    try:
        stop_process_group(polite, "polite", grace=60, say=said.append)
        assert polite.returncode == -signal.SIGTERM
        stop_process_group(stubborn, "stubborn", grace=0.1, say=said.append)
        assert stubborn.returncode == -signal.SIGKILL
    finally:
        for process in (polite, stubborn):
            close_pipes(process)
    assert said == ["stubborn did not stop in 0 s; killing it"]
    stop_process_group(None, "nothing")  # nothing started: nothing to do
    stop_process_group(polite, "again")  # already stopped: no error


#: A process that starts a child in its own process group (``-c`` code, then the leader's pid and
#: the other arguments), then sleeps until its stdin closes.
LEADER = (
    "import os, subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), *sys.argv[2:]]); "
    "print('ready', flush=True); sys.stdin.read()"
)
#: Like Python's resource tracker: cleans up once its parent has gone, which takes a while.
CLEANS_UP_AFTER_ITS_PARENT = (
    "import os, pathlib, sys, time\n"
    "while os.getppid() == int(sys.argv[1]): time.sleep(0.02)\n"
    "time.sleep(0.5)\n"
    "pathlib.Path(sys.argv[2]).write_text('cleaned up')\n"
)
NEVER_LEAVES = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
)


def start_leader(*child: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", LEADER, *child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_rest_of_the_group_may_finish_its_cleanup(tmp_path: Path) -> None:
    marker = tmp_path / "cleaned"
    leader = start_leader(CLEANS_UP_AFTER_ITS_PARENT, str(marker))
    try:
        stop_process_group(leader, "leader", grace=60)
        assert leader.returncode == -signal.SIGTERM
        assert marker.read_text() == "cleaned up"  # not killed halfway
        assert not group_alive(leader.pid)
    finally:
        close_pipes(leader)


def test_what_is_left_of_the_group_is_killed_after_its_grace() -> None:
    leader = start_leader(NEVER_LEAVES)
    try:
        stop_process_group(leader, "leader", grace=60, group_grace=0.2)
        assert leader.returncode == -signal.SIGTERM
        deadline = time.monotonic() + 60  # killed; init reaps it in its own time
        while group_alive(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(leader.pid)
    finally:
        close_pipes(leader)


def test_one_vllm_at_a_time_waits_for_the_holder(tmp_path: Path) -> None:
    lock_path = tmp_path / "vllm.lock"
    with open(lock_path, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        waited: list[str] = []

        def on_wait() -> None:  # the other holder finishes while we wait
            waited.append("waited")
            fcntl.flock(holder, fcntl.LOCK_UN)

        with (
            one_vllm_at_a_time(on_wait, path=lock_path),
            open(lock_path, "a") as probe,
            pytest.raises(BlockingIOError),
        ):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert waited == ["waited"]
    with one_vllm_at_a_time(lambda: waited.append("again"), path=lock_path):
        pass
    assert waited == ["waited"]  # free: no wait
