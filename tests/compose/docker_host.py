"""This machine as a Docker host, for the compose test: the engine, Compose v2, a base image and
the host's pip settings handed into the image builds.

- :func:`ensure_engine` installs what is missing and starts ``dockerd``: Debian's ``docker.io``
  and ``debootstrap`` with apt, and the Compose v2 CLI plugin out of Debian trixie's
  ``docker-compose`` package (bookworm's is Compose v1, which refuses ``compose.yaml``). It needs
  root, as CI has. It returns the one-line reason when no engine can be had (the test skips with
  it), and ``None`` when ``docker compose`` works.
- :func:`ensure_base_image` stands in for ``python:3.11-slim-bookworm`` where Docker Hub cannot be
  reached: Debian bookworm from ``debootstrap`` with Python 3.11, its venv module and CA
  certificates, imported as a local image. Cached by tag.
- :func:`host_pip` reads the host's pip settings (``pip config list``); :func:`torch_index`
  serves the host's local CPU torch wheel as a package index on loopback, for builds that cannot
  reach the PyTorch index. Image builds run on the host's network (``build.network: host``).

How the host's pip settings get into the builds: the index URL and the torch index are build
arguments (the Dockerfiles take them; ``compose.yaml`` passes them from the environment). The
certificate bundle pip trusts (this machine's egress goes through a TLS-intercepting proxy) goes
into the base image with a ``/etc/pip.conf`` naming it: a build argument cannot carry a file, and a
company base image that trusts the company's CA is the same arrangement.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import inspect
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hidden_state_proxy.processes import free_port

#: Debian suite of the stand-in base image (the suite of python:3.11-slim-bookworm).
BASE_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
#: The suite whose ``docker-compose`` package holds the Compose v2 plugin (2.26.1).
COMPOSE_SUITE = "trixie"
#: Where the docker CLI finds system-wide plugins, outside any package's files.
CLI_PLUGIN_DIR = Path("/usr/local/lib/docker/cli-plugins")
DOCKERD_LOG = Path("/var/log/dockerd-vllm-hidden-state-proxy-tests.log")
#: The torch index's loopback port: fixed, because its URL is a build argument and a new value
#: would invalidate the cached multi-GB dependency layer of the CPU vLLM image. Below the
#: ephemeral port range, so that no outgoing connection holds it.
TORCH_INDEX_PORT = 29613


class HostError(RuntimeError):
    """A command on the host failed; the message ends with its output."""


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` and capture its output; raise :class:`HostError` on failure if ``check``."""
    try:
        done = subprocess.run(
            list(argv),
            env=dict(env) if env is not None else None,
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=None if input_text is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as expired:
        raise HostError(f"{shlex.join(argv)}: no answer in {timeout:.0f} s") from expired
    if check and done.returncode != 0:
        raise HostError(
            f"{shlex.join(argv)} exited with {done.returncode}:\n{_tail(done.stdout + done.stderr)}"
        )
    return done


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


# --------------------------------------------------------------------------------------------------
# Engine and Compose


def ensure_engine() -> str | None:
    """Make ``docker compose`` work here; the reason it cannot, or ``None``."""
    try:
        # debootstrap builds the stand-in base image (no registry here): needed on a host that
        # has Docker already, too.
        has_debootstrap = shutil.which("debootstrap") is not None
        if has_debootstrap and _engine_answers() and _compose_v2():
            return None
        if os.geteuid() != 0:
            if not has_debootstrap:
                return (
                    "no debootstrap here (it builds the local base image); installing it needs root"
                )
            return "no Docker engine with Compose v2 here, and installing one needs root"
        missing = [
            package
            for package, tool in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
            if shutil.which(tool) is None
        ]
        if missing:
            _apt_install(missing)
        if not _compose_v2():
            _install_compose_plugin()
        if not _engine_answers():
            _start_dockerd()
    except (HostError, OSError) as problem:
        first = str(problem).splitlines()[0]
        return f"no Docker engine could be installed or started: {first}"
    return None


def _docker() -> str:
    docker = shutil.which("docker")
    if docker is None:
        raise HostError("no docker CLI on PATH")
    return docker


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return run([_docker(), "info"], timeout=30, check=False).returncode == 0


def _compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    done = run([_docker(), "compose", "version", "--short"], timeout=30, check=False)
    major = done.stdout.strip().lstrip("v").split(".")[0]
    return done.returncode == 0 and major.isdigit() and int(major) >= 2


def _apt_install(packages: Sequence[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], timeout=600, env=env)
    run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        timeout=900,
        env=env,
    )


def _install_compose_plugin() -> None:
    """The Compose v2 plugin from Debian trixie's ``docker-compose`` package (a static Go binary),
    fetched with a throwaway apt configuration: the host's sources stay as they are."""
    with tempfile.TemporaryDirectory(prefix="compose-plugin-") as work:
        root = Path(work)
        (root / "lists" / "partial").mkdir(parents=True)
        (root / "sources.list").write_text(f"deb {DEBIAN_MIRROR} {COMPOSE_SUITE} main\n")
        options = [
            "-q",
            "-o",
            f"Dir::Etc::SourceList={root / 'sources.list'}",
            "-o",
            "Dir::Etc::SourceParts=/nonexistent",
            "-o",
            f"Dir::State::Lists={root / 'lists'}",
            "-o",
            f"Dir::Cache={root / 'cache'}",
            "-o",
            "APT::Sandbox::User=root",
        ]
        run(["apt-get", *options, "update"], timeout=600)
        download = subprocess.run(
            ["apt-get", *options, "download", "docker-compose"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
        )
        debs = sorted(root.glob("docker-compose_*.deb"))
        if download.returncode != 0 or not debs:
            raise HostError(f"apt-get download docker-compose:\n{_tail(download.stderr)}")
        run(["dpkg-deb", "-x", str(debs[0]), str(root / "x")], timeout=120)
        plugin = root / "x" / "usr" / "libexec" / "docker" / "cli-plugins" / "docker-compose"
        CLI_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plugin, CLI_PLUGIN_DIR / "docker-compose")


def _start_dockerd(timeout: float = 120) -> None:
    """Start ``dockerd`` as a daemon, as a service would: ``setsid --fork`` leaves it in its own
    session and not the test's child (it stays up after the tests, like the one systemd starts,
    and no ``Popen`` of a process that outlives the session is left behind to warn); wait until
    it answers."""
    with open(DOCKERD_LOG, "ab") as log:
        forked = subprocess.run(
            ["setsid", "--fork", "dockerd"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=30,
        )
    if forked.returncode != 0:
        raise HostError(f"setsid --fork dockerd exited {forked.returncode}; see {DOCKERD_LOG}")
    deadline = time.monotonic() + timeout
    while not _engine_answers():
        if time.monotonic() > deadline:
            raise HostError(
                f"dockerd did not answer in {timeout:.0f} s; {DOCKERD_LOG}:\n"
                + _tail(DOCKERD_LOG.read_text(errors="replace"))
            )
        time.sleep(1)


def versions() -> dict[str, str]:
    """Client, engine and Compose versions, for the test report."""
    docker = _docker()
    fmt = "{{.Client.Version}} {{.Server.Version}}"
    client, engine = run([docker, "version", "--format", fmt], timeout=30).stdout.split()
    compose = run([docker, "compose", "version", "--short"], timeout=30).stdout.strip()
    return {"docker CLI": client, "Docker Engine": engine, "Compose": compose}


def image_exists(tag: str) -> bool:
    return run([_docker(), "image", "inspect", tag], timeout=60, check=False).returncode == 0


# --------------------------------------------------------------------------------------------------
# The host's pip settings


@dataclass(frozen=True)
class HostPip:
    """What pip on this machine uses: ``pip config list``, environment included."""

    cert: Path | None = None
    index_url: str | None = None
    find_links: tuple[str, ...] = field(default_factory=tuple)
    trusted_hosts: tuple[str, ...] = field(default_factory=tuple)


@functools.cache
def host_pip() -> HostPip:
    listing = run([sys.executable, "-m", "pip", "config", "list"], timeout=60).stdout
    # Lines read `scope.key='value'`; the environment (`:env:`) wins over the files.
    settings: dict[str, str] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        key = name.rpartition(".")[2]
        scope = name.rpartition(".")[0]
        if key and (key not in settings or scope == ":env:"):
            settings[key] = value.strip().strip("'\"")
    cert = settings.get("cert")
    return HostPip(
        cert=Path(cert) if cert and Path(cert).is_file() else None,
        index_url=settings.get("index-url"),
        find_links=tuple(settings.get("find-links", "").split()),
        trusted_hosts=tuple(settings.get("trusted-host", "").split()),
    )


def local_torch_wheel(version: str, python_tag: str) -> Path | None:
    """The CPU torch wheel ``torch-<version>+cpu`` for ``python_tag`` in a local find-links
    directory of the host's pip, if there is one."""
    for location in host_pip().find_links:
        directory = Path(location.removeprefix("file://"))
        if directory.is_dir():
            found = sorted(directory.glob(f"torch-{version}+cpu-{python_tag}-*.whl"))
            if found:
                return found[-1]
    return None


@contextlib.contextmanager
def torch_index(wheel: Path) -> Iterator[str]:
    """Serve ``wheel`` as a PEP 503 index on loopback for the block; yields the index URL."""
    with tempfile.TemporaryDirectory(prefix="torch-index-") as root:
        project = Path(root) / "simple" / "torch"
        project.mkdir(parents=True)
        (project / wheel.name).symlink_to(wheel)
        handler = functools.partial(_QuietHandler, directory=root)
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
        except OSError:  # taken: any port works, only the cache of the next build suffers
            server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
        finally:
            server.shutdown()
            server.server_close()
            thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# The base image


def base_image_tag(cert: Path | None) -> str:
    """The stand-in base image's tag: a digest of its recipe (the code that builds it, its suite,
    mirror and packages) and the certificates it trusts, so a changed recipe builds a new one."""
    recipe = (inspect.getsource(ensure_base_image), inspect.getsource(_import))
    digest = hashlib.sha256(repr((recipe, BASE_SUITE, DEBIAN_MIRROR, BASE_PACKAGES)).encode())
    if cert is not None:
        digest.update(cert.read_bytes())
    return f"vllm-hidden-state-test/python:3.11-{BASE_SUITE}-{digest.hexdigest()[:12]}"


def ensure_base_image(cert: Path | None) -> str:
    """A local Debian image in the place of ``python:3.11-slim-bookworm``; built once per tag.

    ``cert``: a CA bundle for pip inside the builds (the host's), written to
    ``/etc/ssl/certs/host-pip-bundle.pem`` and named in ``/etc/pip.conf``.
    """
    tag = base_image_tag(cert)
    if image_exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="base-image-", dir="/var/tmp") as work:
        root = Path(work) / "root"
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    BASE_SUITE,
                    str(root),
                    DEBIAN_MIRROR,
                ],
                timeout=900,
            )
        finally:
            _unmount_below(root)  # what a failed debootstrap left mounted, before the rmtree
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        if cert is not None:
            shutil.copyfile(cert, root / "etc/ssl/certs/host-pip-bundle.pem")
            (root / "etc/pip.conf").write_text(
                "[global]\ncert = /etc/ssl/certs/host-pip-bundle.pem\n"
            )
        _import(root, tag)
    return tag


def _unmount_below(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
        run(["umount", "--lazy", point], timeout=60, check=False)


def _import(root: Path, tag: str) -> None:
    """``tar -C root -c . | docker import - tag``, with the official image's LANG and CMD."""
    changes = ["--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]']
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "-C", str(root), "-c", "."], stdout=subprocess.PIPE
    )
    try:
        done = subprocess.run(
            [_docker(), "import", *changes, "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        if tar.stdout is not None:
            tar.stdout.close()
        tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        raise HostError(f"docker import {tag} failed:\n{_tail(done.stderr)}")
