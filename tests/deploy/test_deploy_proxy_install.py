"""The proxy image's dependency set, without Docker: install the Docker build context (the files
.dockerignore lets through) WITHOUT extras into a fresh venv, as deploy/docker/proxy.Dockerfile
does. The proxy CLI must work there, accept every flag the deployment files pass, and torch must be
absent."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.deploy.commands import chart_commands, compose_commands
from tests.deploy.deploy_helpers import VALUES_FILES, copy_docker_context

#: The base dependencies, and the package itself (whose proxy modules import them all).
BASE_IMPORTS = (
    "import starlette, uvicorn, httpx, aiohttp, msgpack, orjson, numpy, vllm_hidden_state_proxy"
    "; import vllm_hidden_state_proxy.proxy.server"
)


@pytest.fixture(scope="module")
def proxy_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("proxy-image")
    context = copy_docker_context(root / "context")
    assert (context / "pyproject.toml").is_file() and (context / "src").is_dir()
    assert not (context / "tests").exists() and not (context / ".venv").exists()
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(
        [
            str(env_dir / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--no-compile",
            "--quiet",
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return env_dir


def _deployment_proxy_flags() -> set[str]:
    argvs = [compose_commands({}, service=s)["proxy"][0] for s in ("proxy", "proxy-cpu")]
    argvs += [chart_commands(path)["proxy"][0] for path in VALUES_FILES.values()]
    argvs.append(chart_commands(values={"proxy": {"apiKey": {"enabled": False}}})["proxy"][0])
    for argv in argvs:
        assert argv[:2] == ["hidden-state-proxy", "proxy"]
    flags = {arg.split("=", 1)[0] for argv in argvs for arg in argv[2:] if arg.startswith("--")}
    assert {
        "--upstream",
        "--host",
        "--port",
        "--ring-dir",
        "--vector-timeout",
        "--drain-timeout",
        "--metrics-upstream-timeout",
        "--protect-metrics",
        "--allow-unauthenticated",
    } <= flags
    return flags


def test_proxy_cli_works_and_knows_every_deployment_flag(proxy_venv: Path) -> None:
    result = subprocess.run(
        [str(proxy_venv / "bin" / "hidden-state-proxy"), "proxy", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    missing = sorted(flag for flag in _deployment_proxy_flags() if flag not in result.stdout)
    assert missing == []


def test_no_torch_in_the_proxy_environment(proxy_venv: Path) -> None:
    python = str(proxy_venv / "bin" / "python")
    for module in ("torch", "vllm", "transformers"):
        result = subprocess.run(
            [python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0, f"{module} is importable in the proxy environment"
        assert "ModuleNotFoundError" in result.stderr
    # The base dependencies are there, and the package itself imports.
    result = subprocess.run(
        [python, "-c", BASE_IMPORTS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sys.prefix != str(proxy_venv)
