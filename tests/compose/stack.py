"""The compose stack for real: ``compose.yaml`` as shipped, its images built from
``deploy/docker/``, brought up with the documented CPU command and torn down with ``down -v``.

What the test adds to the shipped file, through the environment (the documented settings) and
one override file:

- the environment: the tiny model (``MODEL`` and ``VLLM_EXTRA_ARGS``), a free ``PROXY_PORT``,
  an empty ``HF_CACHE`` of its own (never the user's ``~/.cache/huggingface``),
  test tags for the images (``PROXY_IMAGE``, ``VLLM_CPU_IMAGE``, so a user's own builds are left
  alone), and the build settings: ``PYTHON_BASE_IMAGE`` (the local Debian base), the host's
  package index and the local torch index (see ``docker_host``);
- the override: the model directory bind-mounted read-only into the vLLM container, and
  ``build.network: host`` (this machine reaches the package registries only from its own network
  namespace).

The images are built with the classic builder (``DOCKER_BUILDKIT=0``): Debian's engine has no
BuildKit CLI plugin (buildx), and the classic builder needs no frontend image from Docker Hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from tests.compose import docker_host
from tests.compose.docker_host import HostError, run
from vllm_hidden_state_proxy.processes import free_port, one_vllm_at_a_time

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
#: The documented CPU command's profile, and its two services.
PROFILE = "cpu"
VLLM_SERVICE = "vllm-cpu"
PROXY_SERVICE = "proxy-cpu"
#: Where the model directory appears inside the vLLM container.
MODEL_TARGET = "/models/tiny-chat-model"
SERVED_MODEL_NAME = "tiny-chat"
VLLM_ARGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
    "--served-model-name",
    SERVED_MODEL_NAME,
]
PROXY_IMAGE = "vllm-hidden-state-test/proxy:0.1.0"
VLLM_CPU_IMAGE = "vllm-hidden-state-test/vllm:0.1.0-cpu"
#: The container's Python (the base image's): the torch wheel must match it.
CONTAINER_PYTHON_TAG = "cp311"
BUILD_TIMEOUT = 1800.0
UP_TIMEOUT = 600

#: (phase, seconds) of this session, for the report at the end of the run.
PHASES: list[tuple[str, float]] = []
#: Docker and Compose versions the stack ran on, for the same report.
VERSIONS: dict[str, str] = {}


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        PHASES.append((phase, time.monotonic() - start))


@dataclass
class ComposeStack:
    """A running compose project: its ``docker compose`` command line and its published proxy."""

    project: str
    compose: list[str]
    env: dict[str, str]
    proxy_url: str

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run([*self.compose, *args], env=self.env, timeout=timeout)

    def container(self, service: str) -> str:
        """The id of the service's (one) container."""
        ids = self.run("ps", "--all", "--quiet", service).stdout.split()
        if len(ids) != 1:
            raise HostError(f"{service}: expected one container, got {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        done = run(["docker", "inspect", self.container(service)], timeout=60)
        found: list[dict[str, Any]] = json.loads(done.stdout)
        return found[0]

    def python(self, service: str, code: str, timeout: float = 60) -> str:
        """Run ``python3 -c code`` inside the service's container (as the image's user)."""
        argv = ["docker", "exec", self.container(service), "python3", "-c", code]
        return run(argv, timeout=timeout).stdout

    def logs(self, lines: int = 60) -> str:
        done = run(
            [*self.compose, "logs", "--no-color", "--tail", str(lines)],
            env=self.env,
            timeout=60,
            check=False,
        )
        return done.stdout + done.stderr


def torch_cpu_version() -> str:
    """The torch pin of the package's ``cpu`` extra (the CPU image installs its +cpu build)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["cpu"]:
        name, _, version = requirement.partition("==")
        if name == "torch":
            return str(version)
    raise AssertionError("torch is not pinned in the cpu extra")


def write_override(path: Path, model_dir: Path) -> Path:
    """The test's compose override: JSON is YAML, so no YAML writer is needed."""
    build = {"network": "host"}
    model = {"type": "bind", "source": str(model_dir), "target": MODEL_TARGET, "read_only": True}
    override = {
        "services": {
            VLLM_SERVICE: {"build": build, "volumes": [model]},
            PROXY_SERVICE: {"build": build},
        }
    }
    path.write_text(json.dumps(override, indent=2) + "\n")
    return path


#: The layers the test's vLLM captures (compose passes HIDDEN_STATE_PROXY_LAYERS through).
LAYERS = "1,-1"


def compose_environment(
    base_image: str, proxy_port: int, torch_index_url: str | None, hf_cache: Path
) -> dict[str, str]:
    """The environment ``docker compose`` runs in: this one, with the settings the test gives."""
    pip = docker_host.host_pip()
    env = dict(os.environ)
    for variable in ("COMPOSE_FILE", "COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME", "PIP_INDEX_URL"):
        env.pop(variable, None)
    trusted = list(pip.trusted_hosts)
    if torch_index_url is not None:
        env["TORCH_INDEX_URL"] = torch_index_url
        trusted.append("127.0.0.1")  # the local torch index is plain http
    if pip.index_url is not None and pip.index_url.startswith(("http://", "https://")):
        env["PIP_INDEX_URL"] = pip.index_url  # a local path would not exist inside the build
    env.update(
        {
            "DOCKER_BUILDKIT": "0",
            "PYTHON_BASE_IMAGE": base_image,
            "PIP_TRUSTED_HOST": " ".join(trusted),
            "PROXY_IMAGE": PROXY_IMAGE,
            "VLLM_CPU_IMAGE": VLLM_CPU_IMAGE,
            "MODEL": MODEL_TARGET,
            "VLLM_EXTRA_ARGS": shlex.join(VLLM_ARGS),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PROXY_PORT": str(proxy_port),
            "HF_CACHE": str(hf_cache),
            "HIDDEN_STATE_PROXY_LAYERS": LAYERS,
        }
    )
    return env


def compose_command(project: str, override: Path, env_file: Path) -> list[str]:
    """``docker compose`` for this project: the shipped file, the override, the CPU profile.
    An empty env file: a developer's ``.env`` next to compose.yaml must not change the test."""
    return [
        "docker",
        "compose",
        "--project-name",
        project,
        "--project-directory",
        str(REPO),
        "--env-file",
        str(env_file),
        "--file",
        str(COMPOSE_FILE),
        "--file",
        str(override),
        "--profile",
        PROFILE,
    ]


@contextlib.contextmanager
def _torch_index_if_local() -> Iterator[str | None]:
    wheel = docker_host.local_torch_wheel(torch_cpu_version(), CONTAINER_PYTHON_TAG)
    if wheel is None:  # the PyTorch CPU index, as for users
        yield None
        return
    with docker_host.torch_index(wheel) as url:
        yield url


def build_images(compose: Sequence[str], env: dict[str, str], log: Path) -> None:
    """``docker compose build`` of the CPU profile's images (proxy and CPU vLLM)."""
    with open(log, "w") as out:
        done = subprocess.run(
            [*compose, "build"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT,
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise HostError(f"docker compose build exited with {done.returncode}; {log}:\n{tail}")


def leftovers(project: str) -> dict[str, list[str]]:
    """Containers, volumes and networks still labelled with the compose project."""
    label = f"label=com.docker.compose.project={project}"
    found: dict[str, list[str]] = {}
    for kind, argv in (
        ("containers", ["docker", "ps", "--all", "--quiet", "--filter", label]),
        ("volumes", ["docker", "volume", "ls", "--quiet", "--filter", label]),
        ("networks", ["docker", "network", "ls", "--quiet", "--filter", label]),
    ):
        names = run(argv, timeout=60).stdout.split()
        if names:
            found[kind] = names
    return found


@dataclass(frozen=True)
class BuiltProject:
    """A compose project whose images are built (the CPU profile's), not yet up."""

    project: str
    compose: list[str]
    env: dict[str, str]
    proxy_port: int


def build_project(model_dir: Path, work: Path, project: str) -> BuiltProject:
    """The base image, then ``docker compose build`` of the CPU profile: the proxy image
    (:data:`PROXY_IMAGE`) and the CPU vLLM image (:data:`VLLM_CPU_IMAGE`). The Helm pod test runs
    the same two images, so both tests build them here (the second build is all cache)."""
    VERSIONS.update(docker_host.versions())
    with timed("local base image (debootstrap, cached by tag)"):
        base_image = docker_host.ensure_base_image(docker_host.host_pip().cert)
    proxy_port = free_port()
    env_file = work / "empty.env"
    env_file.write_text("")
    compose = compose_command(
        project, write_override(work / "compose.test.yaml", model_dir), env_file
    )
    hf_cache = work / "hf-cache"  # compose.yaml binds it: it must exist
    hf_cache.mkdir(exist_ok=True)
    with _torch_index_if_local() as torch_index_url:
        env = compose_environment(base_image, proxy_port, torch_index_url, hf_cache)
        with timed("docker compose build (proxy + CPU vLLM images)"):
            build_images(compose, env, work / "build.log")
    return BuiltProject(project=project, compose=compose, env=env, proxy_port=proxy_port)


@contextlib.contextmanager
def run_compose_stack(model_dir: Path, work: Path) -> Iterator[ComposeStack]:
    """Build the images, bring the CPU stack up (holding the machine-wide vLLM lock until it is
    down again) and yield it; ``down -v`` at the end."""
    built = build_project(model_dir, work, f"hsp-compose-test-{os.getpid()}")
    compose, env = built.compose, built.env
    stack = ComposeStack(
        project=built.project,
        compose=compose,
        env=env,
        proxy_url=f"http://127.0.0.1:{built.proxy_port}",
    )
    with one_vllm_at_a_time():
        try:
            with timed("docker compose up --wait (vLLM healthy, then the proxy)"):
                up = run(
                    [*compose, "up", "--detach", "--wait", "--wait-timeout", str(UP_TIMEOUT)],
                    env=env,
                    timeout=UP_TIMEOUT + 120,
                    check=False,
                )
                if up.returncode != 0:
                    raise HostError(
                        f"docker compose up exited with {up.returncode}:\n{up.stderr[-2000:]}\n"
                        f"logs:\n{stack.logs()}"
                    )
            yield stack
        finally:
            with timed("docker compose down -v"):
                run([*compose, "down", "--volumes", "--remove-orphans"], env=env, timeout=300)
