"""The images: every Dockerfile parsed with the official parser (PyPI `dockerfile`), pinned bases,
the proxy's non-root user and entry point, the vLLM images' worker hook, and .dockerignore."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import re
import subprocess
from pathlib import Path
from typing import Any

import dockerfile
import pytest

from tests.deploy.commands import DOCKER_DIR, REPO, image_config
from tests.deploy.deploy_helpers import dockerignore_ignores, dockerignore_rules

DOCKERFILES = sorted(DOCKER_DIR.glob("*Dockerfile"))
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VLLM_ENTRYPOINT = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def parse(path: Path) -> tuple[Any, ...]:
    return dockerfile.parse_file(str(path))


def extra_pin(extra: str, package: str) -> str:
    for requirement in PROJECT["optional-dependencies"][extra]:
        match = re.fullmatch(rf"{re.escape(package)}==([\w.+]+)", requirement)
        if match:
            return match.group(1)
    raise AssertionError(f"{package} is not pinned in the {extra} extra")


def run_text(path: Path) -> str:
    return "\n".join(c.original for c in parse(path) if c.cmd.upper() == "RUN")


def test_the_three_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "proxy.Dockerfile",
        "vllm.Dockerfile",
        "vllm-cpu.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_pinned_by_tag(path: Path) -> None:
    commands = parse(path)
    stages: set[str] = set()
    froms = [c for c in commands if c.cmd.upper() == "FROM"]
    assert froms
    for command in froms:
        image = command.value[0]
        if image in stages:  # FROM an earlier stage
            continue
        assert "$" not in image, f"{image}: no ARG in FROM, pin it literally"
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and "/" not in tag, f"{image}: no tag"
        assert tag != "latest"
        assert re.search(r"\d", tag), f"{image}: tag {tag} names no version"
        if len(command.value) == 3 and command.value[1].upper() == "AS":
            stages.add(command.value[2])


def test_parser_rejects_garbage(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text('FROM python:3.11-slim\nENTRYPOINT ["unterminated\nRUN <<EOF\n')
    with pytest.raises(dockerfile.GoParseError):
        dockerfile.parse_file(str(broken))


def test_proxy_image() -> None:
    path = DOCKER_DIR / "proxy.Dockerfile"
    config = image_config(path)
    assert config["entrypoint"] == ["hidden-state-proxy", "proxy"]
    assert config["entrypoint"][0] in PROJECT["scripts"]
    assert config["from"].startswith("python:3.11") and "slim" in config["from"]
    user = config["user"]
    assert user is not None
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, user  # numeric, so runAsNonRoot can verify it
    assert gid.isdigit() and int(gid) != 0, user
    # Base dependencies only: no extra, no torch, no vLLM.
    text = path.read_text()
    assert "[cpu]" not in text and "[gpu]" not in text
    installs = [c for c in re.split(r"&&|;|\n", run_text(path)) if "pip install" in c]
    assert installs
    assert not [c for c in installs if re.search(r"\b(torch|vllm)", c)], installs
    assert "hidden-state-proxy proxy --help" in run_text(path)


def test_gpu_vllm_image() -> None:
    path = DOCKER_DIR / "vllm.Dockerfile"
    config = image_config(path)
    assert config["from"] == f"vllm/vllm-openai:v{extra_pin('gpu', 'vllm')}"
    assert config["entrypoint"] == VLLM_ENTRYPOINT
    run = run_text(path)
    assert re.search(r"python3 -m pip install [^\n]*/tmp/vllm-hidden-state-proxy", run)
    assert "[gpu]" not in run and "[cpu]" not in run  # never reinstall vLLM/torch over the image's
    assert "vllm.general_plugins" in run and "hidden_state_hook" in run


def test_cpu_vllm_image() -> None:
    path = DOCKER_DIR / "vllm-cpu.Dockerfile"
    config = image_config(path)
    assert config["from"].startswith("python:3.11") and "slim" in config["from"]
    assert config["entrypoint"] == VLLM_ENTRYPOINT
    run = run_text(path)
    assert "[cpu]" in run
    torch = extra_pin("cpu", "torch")
    assert f"torch=={torch}+cpu" in run
    assert "download.pytorch.org/whl/cpu" in run
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", run)
    assert "import torch, transformers, vllm" in run
    assert "hidden_state_hook" in run


def test_package_metadata_the_images_rely_on() -> None:
    assert PROJECT["scripts"]["hidden-state-proxy"]
    assert "hidden_state_hook" in PROJECT["entry-points"]["vllm.general_plugins"]
    assert not any("torch" in dep or "vllm" in dep for dep in PROJECT["dependencies"])


def test_dockerignore() -> None:
    path = REPO / ".dockerignore"
    assert path.is_file()
    rules = dockerignore_rules()
    for sent in ("pyproject.toml", "README.md", "src/vllm_hidden_state_proxy/protocol.py"):
        assert not dockerignore_ignores(sent, rules), sent
    for kept_out in (
        ".venv/bin/python",
        ".git/config",
        "tests/deploy/commands.py",
        "deploy/helm/vllm-hidden-state/values.yaml",
        "src/vllm_hidden_state_proxy/__pycache__/protocol.cpython-311.pyc",
        ".env",
        "compose.yaml",
    ):
        assert dockerignore_ignores(kept_out, rules), kept_out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_run_steps_are_valid_shell(path: Path) -> None:
    """Each shell-form RUN is what /bin/sh -c gets: its syntax must parse (sh -n)."""
    runs = [c for c in parse(path) if c.cmd.upper() == "RUN" and not c.json]
    assert runs
    for run in runs:
        script = " ".join(run.value)
        result = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0, f"{path.name}:{run.start_line}: {result.stderr}"
    broken = subprocess.run(["sh", "-n", "-c", "if true; then echo"], capture_output=True)
    assert broken.returncode != 0
