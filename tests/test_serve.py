"""``hidden-state-proxy serve`` (serve.py): the children's command lines and environments, and
the supervision, with tiny fake servers instead of vLLM and the proxy.

Each supervision test runs ``serve`` as a real subprocess (signals, process groups and exit
statuses are the point) through a runner script that swaps ``vllm_command``/``proxy_command``
for a fake child that answers ``/health`` (the real proxy command line is saved for the tests to
read). The fakes write their pids and their environment to a directory so the tests can check
that nothing is left running and what each child was given. Every ``serve`` also gets an
unreachable ``http_proxy`` in its environment: the health probes must ignore it. No test waits
a fixed time: each waits for a state (a line printed, a file written, a process gone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ring.helpers import directory_lock_held, ring_dir_of
from vllm_hidden_state_proxy import serve, tiny_model
from vllm_hidden_state_proxy.processes import free_port
from vllm_hidden_state_proxy.protocol import (
    API_KEY_ENV,
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    TINY_MODEL_DIR_ENV,
    UPSTREAM_API_KEY_ENV,
    VLLM_API_KEY_ENV,
)
from vllm_hidden_state_proxy.proxy.settings import ProxySettings, command_line
from vllm_hidden_state_proxy.serve_options import RING_DIR_PREFIX

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl"),
    pytest.mark.timeout(180),
]

FAKE_CHILD = r"""
import http.server, json, os, signal, sys, time
from pathlib import Path

role, address, pid_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
mode = os.environ.get("FAKE_" + role.upper(), "")
signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
signal.signal(signal.SIGUSR2, lambda *_: os._exit(0))
if mode == "slow-stop":
    def stop_slowly(*_):
        (pid_dir / f"{role}.stopping").touch()  # the test waits for this, then signals serve
        time.sleep(2)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop_slowly)
names = ("HIDDEN_STATE_PROXY_", "VLLM_PLUGINS", "VLLM_API_KEY", "VLLM_CPU_KVCACHE", "HF_HUB_")
seen = {k: v for k, v in os.environ.items() if k.startswith(names)}
(pid_dir / f".{role}.env").write_text(json.dumps(seen))
(pid_dir / f".{role}.env").rename(pid_dir / f"{role}.env")

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode == "unhealthy" else 200)
        self.end_headers()

    def log_message(self, *args):
        pass

if mode == "refuses":  # the worker hook refused the server's settings, as vLLM's engine would
    from vllm_hidden_state_proxy.ring import FailureNote
    note = FailureNote.write(
        os.environ["HIDDEN_STATE_PROXY_RING_DIR"], instance=7, engine=0, refused_settings=True,
        message="LayerConfigError: Idefics3ForConditionalGeneration does not support auxiliary",
    )
(pid_dir / f".{role}").write_text(str(os.getpid()))
(pid_dir / f".{role}").rename(pid_dir / role)  # atomic: the test never reads half a pid
if mode == "silent":  # runs, never listens
    signal.pause()
if address.startswith("/"):  # vLLM's --uds
    import socketserver
    server = socketserver.UnixStreamServer(address, Health)
else:
    server = http.server.HTTPServer(("127.0.0.1", int(address)), Health)
server.serve_forever()
"""

RUNNER = r"""
import json, os, sys
from pathlib import Path
from vllm_hidden_state_proxy import serve
from vllm_hidden_state_proxy.cli import main

child, pid_dir = sys.argv[1], Path(sys.argv[2])
real_proxy_command, real_vllm_command = serve.proxy_command, serve.vllm_command


def vllm_command(model, port, extra, *, uds=None):
    (pid_dir / "vllm.argv").write_text(json.dumps([model, port, uds, *extra]))
    real = real_vllm_command(model, port, extra, uds=uds)
    (pid_dir / "vllm.command").write_text(json.dumps(real))
    return [sys.executable, child, "vllm", uds or str(port), str(pid_dir)]


def proxy_command(settings):
    (pid_dir / "proxy.argv").write_text(json.dumps(real_proxy_command(settings)))
    return [sys.executable, child, "proxy", str(settings.port), str(pid_dir)]


# Generous by default (a loaded machine starts the fake proxy slowly); the test of a proxy that
# never answers sets it low, to see serve give up.
serve.PROXY_STARTUP_TIMEOUT = float(os.environ.get("FAKE_PROXY_STARTUP_TIMEOUT", "60"))
serve.startup_canary = lambda url, settings: None  # the fake proxy serves no completions
serve.vllm_command = vllm_command
serve.proxy_command = proxy_command
model = [os.environ["FAKE_MODEL"]] if os.environ.get("FAKE_MODEL") != "" else []
sys.exit(main(["serve", *model, *sys.argv[3:]]))
"""

UNREACHABLE_PROXY = "http://127.0.0.1:9"


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

    def __init__(
        self,
        tmp_path: Path,
        *options: str,
        environ: dict[str, str] | None = None,
        **fake_modes: str,
    ) -> None:
        tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one test may start several
        (tmp_path / "child.py").write_text(FAKE_CHILD)
        (tmp_path / "runner.py").write_text(RUNNER)
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
        env.update(http_proxy=UNREACHABLE_PROXY, HTTP_PROXY=UNREACHABLE_PROXY)
        env.update({f"FAKE_{role.upper()}": mode for role, mode in fake_modes.items()})
        env.setdefault("FAKE_MODEL", "fake-model")  # the model serve is given ("": none)
        env.update(environ or {})
        runner = [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "child.py")]
        ports = ["--port", str(self.port)]
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

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        if not wait_until(lambda: text in self.output, timeout):
            pytest.fail(f"{text!r} not printed within {timeout} s; stderr:\n{self.output}")

    def pid(self, role: str) -> int:
        path = self.pid_dir / role
        assert wait_until(path.exists, 10.0), f"no {role} started; stderr:\n{self.output}"
        return int(path.read_text())

    def ready(self, timeout: float = 60.0) -> tuple[int, int]:
        url = f"http://127.0.0.1:{self.port}/v1"
        self.wait_for(f"ready: OpenAI-compatible API at {url}", timeout)
        return self.pid("vllm"), self.pid("proxy")

    def wait(self, timeout: float = 60.0) -> int:
        status = self.process.wait(timeout)
        self._reader.join(5)
        return status

    def child_environment(self, role: str) -> dict[str, str]:
        path = self.pid_dir / f"{role}.env"
        assert wait_until(path.exists, 10.0), f"no {role} started; stderr:\n{self.output}"
        environment: dict[str, str] = json.loads(path.read_text())
        return environment

    def saved_argv(self, role: str) -> list[Any]:
        """What serve asked the runner for (``vllm.command``: the real vLLM command line)."""
        name = role if "." in role else f"{role}.argv"
        argv: list[Any] = json.loads((self.pid_dir / name).read_text())
        return argv

    def ring_dir(self) -> Path:
        match = re.search(r"\(ring directory (\S+)\)", self.output)
        assert match, self.output
        return Path(match[1])

    def close(self) -> None:
        """Whatever a failed test left behind."""
        self.process.kill()
        self.process.wait()
        self._reader.join(10)
        if self.process.stderr is not None:
            self.process.stderr.close()
        for role in ("vllm", "proxy"):
            path = self.pid_dir / role
            if path.exists() and alive(pid := int(path.read_text())):
                os.kill(pid, signal.SIGKILL)
        match = re.search(r"\(ring directory (\S+)\)", self.output)
        if match:  # this serve's own directory (or one under tmp_path)
            shutil.rmtree(match[1], ignore_errors=True)
        match = re.search(r"starting vLLM on (/\S+) ", self.output)
        if match and Path(match[1]).parent.name.startswith(serve.SOCKET_DIR_PREFIX):
            shutil.rmtree(Path(match[1]).parent, ignore_errors=True)  # serve was killed


Starter = Callable[..., Serve]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Starter]:
    started: list[Serve] = []

    def starter(*options: str, environ: dict[str, str] | None = None, **fake_modes: str) -> Serve:
        started.append(Serve(tmp_path, *options, environ=environ, **fake_modes))
        return started[-1]

    yield starter
    for server in started:
        server.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_both_children_and_exits_0(start: Starter, signum: int) -> None:
    server: Serve = start()
    vllm, proxy = server.ready()
    ring_dir = server.ring_dir()
    assert ring_dir.name.startswith(RING_DIR_PREFIX) and ring_dir.is_dir()
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
    assert wait_until((server.pid_dir / "proxy.stopping").exists, 10.0)  # serve is stopping it
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
        server: Serve = start(option, taken)  # the last --port/--vllm-port wins
        assert server.wait(timeout=30) != 0
    assert f"port {taken} on 127.0.0.1 is not available" in server.output
    assert f"choose another port with {option}\n" in server.output
    assert not (server.pid_dir / "vllm").exists()  # refused before anything started


def test_a_socket_of_the_users_for_vllm_is_refused_at_once(start: Starter) -> None:
    server: Serve = start("--uds", "/tmp/elsewhere.sock")  # not serve's: it would go to vLLM
    assert server.wait(timeout=30) == 1
    assert "--uds cannot be passed to vLLM" in server.output
    assert not (server.pid_dir / "vllm").exists()


RING_DIR_CASES = [
    ("symlink", "is a symbolic link"),
    ("sticky", "/tmp-like"),
    ("foreign", "owned by uid 65534"),
]


@pytest.mark.parametrize(("case", "why"), RING_DIR_CASES)
def test_ring_dir_problem(tmp_path: Path, case: str, why: str) -> None:
    problem = serve.ring_dir_problem(str(ring_dir_of(tmp_path, case)))
    assert problem is not None and why in problem and str(tmp_path / "rings") in problem


def test_ring_dir_problem_of_a_held_lock_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring_dir = ring_dir_of(tmp_path, "held")
    monkeypatch.setattr(serve, "RING_LOCK_PROBE", 0.2)
    with directory_lock_held(ring_dir) as pid:
        started = time.monotonic()
        problem = serve.ring_dir_problem(str(ring_dir))
        assert time.monotonic() - started < 5
    assert problem is not None and f"the lock of the ring directory {ring_dir} is held" in problem
    if Path("/proc/locks").exists():
        assert problem.endswith(f"held by pid {pid}")
    assert serve.ring_dir_problem(str(ring_dir)) is None  # released


def test_ring_dir_problem_accepts_what_the_hook_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert serve.ring_dir_problem(str(tmp_path / "missing")) is None  # the hook makes it
    ring_dir = ring_dir_of(tmp_path, "own")
    assert serve.ring_dir_problem(str(ring_dir)) is None
    os.chmod(ring_dir, 0o2777)  # this user's own: repaired, as the hook would
    monkeypatch.setenv(RING_DIR_MODE_ENV, "0770")
    assert serve.ring_dir_problem(str(ring_dir)) is None
    assert stat.S_IMODE(ring_dir.stat().st_mode) == 0o2775
    monkeypatch.setenv(RING_DIR_MODE_ENV, "rw")
    assert "is not an octal mode" in (serve.ring_dir_problem(str(ring_dir)) or "")


@pytest.mark.parametrize(("case", "why"), RING_DIR_CASES[:2])
def test_a_ring_dir_the_hook_would_refuse_fails_before_vllm_starts(
    start: Starter, tmp_path: Path, case: str, why: str
) -> None:
    ring_dir = ring_dir_of(tmp_path, case)
    server: Serve = start("--ring-dir", str(ring_dir))
    assert server.wait(timeout=30) == 1
    assert why in server.output
    assert not (server.pid_dir / "vllm").exists()  # refused before anything started
    assert ring_dir.exists()  # a --ring-dir is the user's: never removed


def a_model(path: Path, config: Any) -> Path:
    """A model directory holding only its ``config.json``: nothing vLLM could load."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_layers_the_model_lacks_are_refused_before_vllm_starts(
    start: Starter, tmp_path: Path
) -> None:
    """The README's layers of a 28-layer model, given to a 2-layer one: refused in seconds
    with the sentence the hook would have written after the load, and nothing started."""
    model = a_model(tmp_path / "two-layers", {"num_hidden_layers": 2})
    started = time.monotonic()
    server: Serve = start("--hidden-state-layers", "8,16,-1", environ={"FAKE_MODEL": str(model)})
    assert server.wait(timeout=30) == 1, server.output
    assert time.monotonic() - started < 20
    assert (
        "vLLM cannot serve what it was started with: HIDDEN_STATE_PROXY_LAYERS='8,16,-1': "
        "layer 8 is out of range for a model with 2 layers (valid: 0..2, or -3..-1) "
        f"(num_hidden_layers of {model / 'config.json'}, read before loading the model)"
    ) in server.output
    assert not (server.pid_dir / "vllm").exists() and "starting vLLM" not in server.output


def test_layers_the_model_has_go_on_to_vllm(start: Starter, tmp_path: Path) -> None:
    model = a_model(tmp_path / "two-layers", {"num_hidden_layers": 2})
    server: Serve = start("--hidden-state-layers", "0,1,-1", environ={"FAKE_MODEL": str(model)})
    server.ready()
    assert server.child_environment("vllm")[LAYERS_ENV] == "0,1,-1"
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output


#: Building the tiny model (torch and Transformers imported, a tokenizer trained): seconds,
#: more on a busy machine.
TINY_BUILD = 120.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where serve --tiny-model builds the tiny model: the first test builds it, the next reuse."""
    return tmp_path_factory.mktemp("tiny-model") / "tiny"


@pytest.mark.timeout(TINY_BUILD + 60)
def test_tiny_model_serves_the_built_in_model_under_the_name_given(
    start: Starter, tiny_dir: Path
) -> None:
    """The README's path without a hub: serve NAME --tiny-model."""
    tiny = tiny_dir
    server: Serve = start(
        "--tiny-model",
        "--max-model-len",  # the user's own vLLM options come after the tiny model's: they win
        "1024",
        environ={"FAKE_MODEL": "Qwen/Qwen3-0.6B", TINY_MODEL_DIR_ENV: str(tiny)},
    )
    server.ready(timeout=TINY_BUILD)
    model, _, _, *extra = server.saved_argv("vllm")
    assert model == str(tiny) and (tiny / "config.json").is_file()
    assert extra == [
        "--served-model-name",
        "Qwen/Qwen3-0.6B",
        *tiny_model.SERVE_VLLM_ARGS,
        "--max-model-len",
        "1024",
    ]
    vllm_env = server.child_environment("vllm")
    for name, value in tiny_model.SERVE_ENVIRONMENT.items():
        if name.startswith(("VLLM_CPU_KVCACHE", "HF_HUB_")):
            assert vllm_env[name] == (os.environ.get(name) or value)  # the user's, where set
    assert f"serving the tiny model {tiny} as Qwen/Qwen3-0.6B" in server.output
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output


@pytest.mark.timeout(TINY_BUILD + 60)
def test_tiny_model_checks_its_layers_before_vllm_starts(start: Starter, tiny_dir: Path) -> None:
    server: Serve = start(
        "--tiny-model",
        "--hidden-state-layers",
        "3",
        environ={"FAKE_MODEL": "", TINY_MODEL_DIR_ENV: str(tiny_dir)},
    )
    assert server.wait(timeout=TINY_BUILD) == 1, server.output
    assert "layer 3 is out of range for a model with 2 layers" in server.output
    assert not (server.pid_dir / "vllm").exists()


def test_proxy_that_never_answers_is_given_up_on(start: Starter) -> None:
    server: Serve = start(proxy="silent", environ={"FAKE_PROXY_STARTUP_TIMEOUT": "2"})
    vllm, proxy = server.pid("vllm"), server.pid("proxy")
    assert server.wait() == 1, server.output
    assert "the proxy was not healthy after 2 s; giving up" in server.output
    assert not alive(vllm) and not alive(proxy)


def test_a_proxy_that_answers_but_is_not_ready_is_reported_and_kept(start: Starter) -> None:
    """An engine without a ring makes the proxy's /health 503 once vLLM is healthy: serve
    says so and goes on serving (the other engines and ordinary traffic work)."""
    server: Serve = start(proxy="unhealthy")
    vllm, proxy = server.ready()
    assert "the proxy is up after" in server.output and "but not ready (503)" in server.output
    assert alive(vllm) and alive(proxy)


def test_a_hook_that_refused_the_servers_settings_fails_the_startup(start: Starter) -> None:
    """Layers the model cannot return: vLLM serves (the hook never fails it), serve does not."""
    server: Serve = start(vllm="refuses")
    vllm = server.pid("vllm")
    assert server.wait() == 1, server.output
    assert "vLLM cannot serve what it was started with: engine 0" in server.output
    assert "Idefics3ForConditionalGeneration does not support auxiliary" in server.output
    assert not (server.pid_dir / "proxy").exists()  # the proxy was never started
    assert "ready:" not in server.output
    assert not alive(vllm)


def test_refused_settings_are_only_those_of_its_own_vllm(tmp_path: Path) -> None:
    """A ring directory may be shared: another server's refusal is not this one's."""
    from vllm_hidden_state_proxy.ring import FailureNote

    refused = FailureNote.write(tmp_path, instance=1, engine=0, message="m", refused_settings=True)
    off = FailureNote.write(tmp_path, instance=1, engine=1, message="hook off")
    try:
        mine = serve.refused_settings(str(tmp_path), os.getpgid(0))
        assert [(f.engine, f.message) for f in mine] == [(0, "m")]
        assert serve.refused_settings(str(tmp_path), os.getpgid(0) + 1_000_000) == []
        # What serve prints in full (the proxy's /health says it in words only): every one.
        every = serve.own_failures(str(tmp_path), os.getpgid(0))
        assert sorted(f.message for f in every) == ["hook off", "m"]
        assert serve.own_failures(str(tmp_path), os.getpgid(0) + 1_000_000) == []
    finally:
        refused.close()
        off.close()


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


def test_the_children_get_their_settings_and_secrets_stay_out_of_argv(
    start: Starter, tmp_path: Path
) -> None:
    ring_dir = tmp_path / "shared-rings"
    ring_dir.mkdir()  # e.g. a volume shared with another serve
    server: Serve = start(
        "--ring-dir",
        str(ring_dir),
        "--hidden-state-layers",
        "4,8,-1",
        "--api-key",
        "proxy-secret",
        "--vector-timeout",
        "2.5",
        "--embedding-layer",
        "-2",
        "--max-model-len",  # not serve's: passed to vLLM unchanged
        "4096",
    )
    server.ready()
    vllm_env = server.child_environment("vllm")
    assert vllm_env[RING_DIR_ENV] == str(ring_dir)
    assert vllm_env[LAYERS_ENV] == "4,8,-1"
    assert API_KEY_ENV not in vllm_env
    model, port, uds, *extra = server.saved_argv("vllm")
    assert (model, port, extra) == ("fake-model", None, ["--max-model-len", "4096"])
    proxy_env = server.child_environment("proxy")
    assert proxy_env[API_KEY_ENV] == "proxy-secret"
    argv = server.saved_argv("proxy")
    assert argv[1:4] == ["-m", "vllm_hidden_state_proxy.cli", "proxy"]
    assert not any("proxy-secret" in arg for arg in argv)
    for option in (
        "--upstream=http://localhost",
        f"--upstream-uds={uds}",
        f"--ring-dir={ring_dir}",
        f"--port={server.port}",
        "--vector-timeout=2.5",
        "--embedding-layer=-2",
    ):
        assert option in argv, argv
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output
    assert ring_dir.is_dir()  # a directory given with --ring-dir is not removed


def _private_to_me(path: Path) -> bool:
    status = path.stat()
    return status.st_uid == os.geteuid() and status.st_mode & 0o777 == 0o700


def test_vllm_listens_on_a_private_socket_with_a_key_only_the_proxy_gets(start: Starter) -> None:
    """The default layout (issue #25): no TCP port for vLLM; its socket in a fresh 0700
    directory; a fresh random key, in vLLM's and the proxy's environments only."""
    server: Serve = start()
    server.ready()
    _, port, uds, *_ = server.saved_argv("vllm")
    assert port is None and uds is not None
    socket_path = Path(uds)
    assert socket_path.is_socket(), server.output
    assert socket_path.name == serve.VLLM_SOCKET_NAME
    assert socket_path.parent.name.startswith(serve.SOCKET_DIR_PREFIX)
    assert _private_to_me(socket_path.parent)
    assert len(os.fsencode(uds)) < 108
    key = server.child_environment("vllm")[VLLM_API_KEY_ENV]
    assert len(key) >= 32
    proxy_env = server.child_environment("proxy")
    assert proxy_env[UPSTREAM_API_KEY_ENV] == key
    proxy_argv = server.saved_argv("proxy")
    assert f"--upstream-uds={uds}" in proxy_argv
    vllm_argv = server.saved_argv("vllm.command")
    assert vllm_argv[vllm_argv.index("--uds") + 1] == uds and "--port" not in vllm_argv
    assert not any(key in arg for arg in [*vllm_argv, *proxy_argv])
    assert f"starting vLLM on {uds} " in server.output
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output
    assert not socket_path.parent.exists()


def test_each_serve_gets_its_own_key(start: Starter) -> None:
    first, second = start(), start()
    first.ready()
    second.ready()
    keys = {s.child_environment("vllm")[VLLM_API_KEY_ENV] for s in (first, second)}
    assert len(keys) == 2


def test_vllm_port_opts_into_loopback_tcp_still_with_the_key(start: Starter) -> None:
    vllm_port = free_port()
    server: Serve = start("--vllm-port", str(vllm_port))
    server.ready()
    assert server.saved_argv("vllm")[:3] == ["fake-model", vllm_port, None]
    proxy_argv = server.saved_argv("proxy")
    assert f"--upstream=http://127.0.0.1:{vllm_port}" in proxy_argv
    assert not any(arg.startswith("--upstream-uds") for arg in proxy_argv)
    key = server.child_environment("vllm")[VLLM_API_KEY_ENV]
    assert server.child_environment("proxy")[UPSTREAM_API_KEY_ENV] == key
    assert f"starting vLLM on 127.0.0.1:{vllm_port} " in server.output


def test_a_chosen_upstream_key_is_vllms_key(start: Starter) -> None:
    """For tools that must reach vLLM directly (the bench's direct arms, the e2e tests)."""
    server: Serve = start("--upstream-api-key", "chosen-vllm-key")
    server.ready()
    assert server.child_environment("vllm")[VLLM_API_KEY_ENV] == "chosen-vllm-key"
    assert server.child_environment("proxy")[UPSTREAM_API_KEY_ENV] == "chosen-vllm-key"
    assert not any("chosen-vllm-key" in arg for arg in server.saved_argv("proxy"))


def test_a_users_vllm_api_key_is_the_proxys_and_vllm_keeps_a_private_one(start: Starter) -> None:
    """``VLLM_API_KEY=K vllm serve M`` moved to ``serve``: clients still need K (now at the
    proxy, which listens on all interfaces as vLLM did), and vLLM gets serve's own key."""
    server: Serve = start(environ={VLLM_API_KEY_ENV: "users-key", API_KEY_ENV: ""})
    server.ready()
    assert server.child_environment("proxy")[API_KEY_ENV] == "users-key"
    vllm_key = server.child_environment("vllm")[VLLM_API_KEY_ENV]
    assert vllm_key != "users-key" and len(vllm_key) >= 32
    assert server.child_environment("proxy")[UPSTREAM_API_KEY_ENV] == vllm_key
    argv = server.saved_argv("proxy")
    assert "--host=0.0.0.0" in argv
    assert not any("users-key" in arg for arg in argv)
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output


def test_the_proxy_gets_its_drain_time_and_serve_waits_for_it(start: Starter) -> None:
    server: Serve = start("--drain_timeout", "30", proxy="slow-stop")
    server.ready()
    assert "--drain-timeout=30.0" in server.saved_argv("proxy")
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output
    # The proxy's 30 s and a margin of 5, vLLM's 20, and 10 more for each process group.
    assert "can take up to 75 s" in server.output
    assert "did not stop" not in server.output, server.output  # the fake proxy takes 2 s


def test_without_layers_vllm_gets_no_layer_setting(start: Starter) -> None:
    server: Serve = start()
    server.ready()
    vllm_env = server.child_environment("vllm")
    assert LAYERS_ENV not in vllm_env
    assert vllm_env[RING_DIR_ENV] == str(server.ring_dir())
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output


# ---------------------------------------------------------------------------------------------
# the pieces, in this process
# ---------------------------------------------------------------------------------------------


def test_proxy_command_and_environment() -> None:
    # Keys no path holds (a checkout in /tmp/ci-check2 holds "k2").
    key, upstream_key = "proxy-key-Zq81", "vllm-key-Zq82"
    settings = ProxySettings(
        upstream_url="http://127.0.0.1:8001", api_key=key, upstream_api_key=upstream_key, port=9000
    )
    command = serve.proxy_command(settings)
    assert command[:4] == [sys.executable, "-m", "vllm_hidden_state_proxy.cli", "proxy"]
    assert command[4:] == command_line(settings)
    assert not any(key in arg or upstream_key in arg for arg in command)
    environment = serve.proxy_environment(settings)
    assert (environment[API_KEY_ENV], environment[UPSTREAM_API_KEY_ENV]) == (key, upstream_key)
    assert environment["PATH"] == os.environ["PATH"]


def test_proxy_settings_for_serve() -> None:
    from vllm_hidden_state_proxy.cli import build_parser

    args, extra = build_parser().parse_known_args(
        ["serve", "m", "--port=9", "--fan-out-limit=3", "--dtype", "float16"]
    )
    vllm = serve.VllmAccess.for_serve(None, "/run/private", "k")
    settings = serve.proxy_settings_for(args, vllm, "/rings")
    assert (settings.upstream_url, settings.ring_dir) == ("http://localhost", "/rings")
    assert (settings.upstream_uds, settings.upstream_api_key) == ("/run/private/vllm.sock", "k")
    assert (settings.port, settings.fan_out_limit) == (9, 3)
    assert extra == ["--dtype", "float16"]
    tcp = serve.proxy_settings_for(args, serve.VllmAccess.for_serve(8001, None, "k"), "/rings")
    assert (tcp.upstream_url, tcp.upstream_uds) == ("http://127.0.0.1:8001", None)


def test_serve_decides_how_the_proxy_reaches_vllm() -> None:
    """serve has no --upstream/--upstream-uds: a proxy pointed elsewhere would defeat it."""
    from vllm_hidden_state_proxy.cli import build_parser

    parser = build_parser()
    for option in ("--upstream=http://elsewhere", "--upstream-uds=/tmp/other.sock"):
        _, extra = parser.parse_known_args(["serve", "m", option])
        assert extra == [option]  # not serve's: it would go to vLLM, which refuses it


def test_socket_directory_falls_back_when_tmpdir_is_too_long(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    path = Path(serve._private_socket_dir())
    try:
        assert path.parent == Path("/tmp") and _private_to_me(path)
        assert not list(deep.iterdir())  # the too-long one was removed
    finally:
        path.rmdir()


@pytest.mark.parametrize(
    ("inherited", "layers", "expected_plugins", "expected_layers"),
    [
        ({}, None, None, None),
        ({}, (4, 8, -1), None, "4,8,-1"),
        ({"VLLM_PLUGINS": "other"}, (0,), "other,hidden_state_hook", "0"),
        ({"VLLM_PLUGINS": " hidden_state_hook , other"}, None, " hidden_state_hook , other", None),
        ({"VLLM_PLUGINS": ""}, None, "hidden_state_hook", None),
    ],
)
def test_vllm_environment(
    monkeypatch: pytest.MonkeyPatch,
    inherited: dict[str, str],
    layers: tuple[int, ...] | None,
    expected_plugins: str | None,
    expected_layers: str | None,
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    monkeypatch.setenv(HOOK_ENABLED_ENV, "0")  # serve always wants the hook on
    for name, value in inherited.items():
        monkeypatch.setenv(name, value)
    environment = serve.vllm_environment("/rings", "vllm-key", layers)
    assert environment[RING_DIR_ENV] == "/rings"
    assert environment[VLLM_API_KEY_ENV] == "vllm-key"
    assert HOOK_ENABLED_ENV not in environment
    assert environment.get("VLLM_PLUGINS") == expected_plugins
    assert environment.get(LAYERS_ENV) == expected_layers


def test_port_problem_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    same = Namespace(host="127.0.0.1", port=9, vllm_port=9)
    assert serve.port_problem(same) == (
        "--port and --vllm-port are both 9; choose two different ports"
    )
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        problem = serve.port_problem(Namespace(host="127.0.0.1", port=free_port(), vllm_port=taken))
    assert problem is not None and problem.endswith("choose another port with --vllm-port")
    assert (
        serve.port_problem(Namespace(host="127.0.0.1", port=free_port(), vllm_port=free_port()))
        is None
    )
    # vLLM on its socket (no --vllm-port): only the proxy's port matters.
    assert serve.port_problem(Namespace(host="127.0.0.1", port=free_port(), vllm_port=None)) is None


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:80"),
        ("", "http://127.0.0.1:80"),
        ("::", "http://127.0.0.1:80"),
        ("10.0.0.2", "http://10.0.0.2:80"),
        ("::1", "http://[::1]:80"),
        ("[::1]", "http://[::1]:80"),
    ],
)
def test_local_url(host: str, url: str) -> None:
    assert serve._local_url(host, 80) == url


def test_a_startup_check_without_an_answer_in_time_does_not_stop_serve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Traffic sent as soon as the proxy's /health answered can hold vLLM past the check's
    timeout (seen: extract started against serve at once, 512 inputs in flight): no verdict,
    serve goes on and says so. A check that got an answer still decides."""
    from vllm_hidden_state_proxy import check

    def unanswered(client: Any) -> str | None:
        raise check.CheckUnanswered("The proxy did not answer /v1/completions in time")

    settings = ProxySettings(upstream_url="http://127.0.0.1:9", ring_dir="/tmp/none")
    monkeypatch.setattr(check, "canary", unanswered)
    assert serve.startup_canary("http://127.0.0.1:9", settings) is None
    said = capsys.readouterr().err
    assert "got no answer in" in said and "hidden-state-proxy check" in said
    monkeypatch.setattr(check, "canary", lambda client: "A flagged request got 504: lost")
    assert serve.startup_canary("http://127.0.0.1:9", settings) == "A flagged request got 504: lost"
