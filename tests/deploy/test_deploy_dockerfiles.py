"""The images: every Dockerfile parsed with the official parser (PyPI `dockerfile`), pinned bases,
the proxy's non-root user and entry point, the vLLM images' worker hook, the build arguments, and
.dockerignore. (tests/compose builds and runs them for real.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import tomllib

from tests.deploy.commands import DOCKER_DIR, REPO, image_config
from tests.deploy.deploy_helpers import declared_args, dockerignore_ignores, dockerignore_rules

DOCKERFILES = sorted(DOCKER_DIR.glob("*Dockerfile"))
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VLLM_ENTRYPOINT = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def parse(path: Path) -> tuple[Any, ...]:
    commands: tuple[Any, ...] = dockerfile.parse_file(str(path))
    return commands


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
    """Every base is a build argument (a mirror or registry can substitute its own) whose default
    is the public image, pinned by a version tag."""
    commands = parse(path)
    stages: set[str] = set()
    froms = [c for c in commands if c.cmd.upper() == "FROM"]
    assert froms
    defaults = declared_args(path)
    for command in froms:
        written = command.value[0]
        if written in stages:  # FROM an earlier stage
            continue
        assert written == "${BASE_IMAGE}", f"{written}: FROM the BASE_IMAGE build argument"
        image = defaults["BASE_IMAGE"]
        assert image, "BASE_IMAGE has no default"
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and "/" not in tag, f"{image}: no tag"
        assert tag != "latest"
        assert re.search(r"\d", tag), f"{image}: tag {tag} names no version"
        if len(command.value) == 3 and command.value[1].upper() == "AS":
            stages.add(command.value[2])
    # Declared before the first FROM, where FROM can see it.
    first_from = min(c.start_line for c in froms)
    assert any(
        c.cmd.upper() == "ARG"
        and c.value[0].startswith("BASE_IMAGE=")
        and c.start_line < first_from
        for c in commands
    )


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_no_syntax_directive(path: Path) -> None:
    """BuildKit fetches the frontend a `# syntax=` line names from Docker Hub, which an air-gapped
    site (and this machine) cannot reach; no Dockerfile here uses a feature that needs one."""
    assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.MULTILINE | re.IGNORECASE)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_pip_settings_are_build_arguments(path: Path) -> None:
    """The package index is a build argument with the public default; pip reads PIP_INDEX_URL and
    PIP_TRUSTED_HOST from the environment, which ARGs are during RUN (and are not in the image)."""
    args = declared_args(path)
    assert args["PIP_INDEX_URL"] == "https://pypi.org/simple"
    assert args["PIP_TRUSTED_HOST"] == ""
    text = path.read_text()
    assert "ENV PIP_INDEX_URL" not in text and "ENV PIP_TRUSTED_HOST" not in text


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


#: Users and groups of Debian's base-passwd (/usr/share/base-passwd/{passwd,group}.master): every
#: Debian image has them, so `groupadd`/`useradd` of one of these names fails.
_BASE_PASSWD = """
root daemon bin sys sync games man lp mail news uucp proxy www-data backup list irc _apt nobody
adm tty disk kmem dialout fax voice cdrom floppy tape sudo audio dip operator src shadow utmp
video sasl plugdev staff users nogroup
"""
DEBIAN_BASE_NAMES = set(_BASE_PASSWD.split())


def test_proxy_user_does_not_collide_with_debian() -> None:
    """`groupadd proxy` failed on every Debian base (issue #16): base-passwd has `proxy` (13)."""
    path = DOCKER_DIR / "proxy.Dockerfile"
    run = run_text(path)
    for tool in ("groupadd", "useradd"):
        (invocation,) = re.findall(rf"{tool}\s[^&\n]*", run)
        words = invocation.split()
        assert words[-1] not in DEBIAN_BASE_NAMES, invocation
        ids = [words[i + 1] for i, w in enumerate(words) if w in ("--gid", "--uid")]
        assert ids and set(ids) == {"10001"}, invocation
    assert image_config(path)["user"] == "10001:10001"
    for name in ("/usr/share/base-passwd/passwd.master", "/usr/share/base-passwd/group.master"):
        master = Path(name)
        if master.is_file():  # the list above is Debian's, where this runs on Debian
            names = {line.split(":")[0] for line in master.read_text().splitlines() if line}
            assert names <= DEBIAN_BASE_NAMES, names - DEBIAN_BASE_NAMES


def test_gpu_vllm_image() -> None:
    path = DOCKER_DIR / "vllm.Dockerfile"
    config = image_config(path)
    assert config["from"] == f"vllm/vllm-openai:v{extra_pin('gpu', 'vllm')}"
    assert config["entrypoint"] == VLLM_ENTRYPOINT
    run = run_text(path)
    assert re.search(r"python3 -m pip install [^\n]*/tmp/vllm-hidden-state-proxy", run)
    assert "[gpu]" not in run and "[cpu]" not in run  # never reinstall vLLM/torch over the image's
    assert "vllm.general_plugins" in run and "hidden_state_hook" in run


def test_make_test_vllm_next_tests_the_gpu_extras_vllm() -> None:
    """The Makefile's default ``NEXT_VLLM`` (the wheel the hook's unit tests run on, which
    CONTRIBUTING's table names as tested) is the ``gpu`` extra's pin, which the GPU image's base
    follows: bumping one without the other would ship an untested vLLM."""
    makefile = (REPO / "Makefile").read_text()
    defaults = re.findall(r"^NEXT_VLLM \?= (\S+)$", makefile, flags=re.MULTILINE)
    assert defaults == [extra_pin("gpu", "vllm")]


def test_cpu_vllm_image() -> None:
    path = DOCKER_DIR / "vllm-cpu.Dockerfile"
    config = image_config(path)
    assert config["from"].startswith("python:3.11") and "slim" in config["from"]
    assert config["from"] == image_config(DOCKER_DIR / "proxy.Dockerfile")["from"]
    assert config["entrypoint"] == VLLM_ENTRYPOINT
    run = run_text(path)
    assert "['optional-dependencies']['cpu']" in run  # the extra's pins, read from pyproject.toml
    torch = extra_pin("cpu", "torch")
    assert f"torch=={torch}+cpu" in run
    assert config["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert '--extra-index-url "$TORCH_INDEX_URL"' in run
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", run)
    assert "import torch, transformers, vllm" in run
    assert "hidden_state_hook" in run


def _instructions(path: Path) -> list[tuple[str, str]]:
    return [(c.cmd.upper(), c.original) for c in parse(path)]


def test_vllm_images_differ_only_where_they_must() -> None:
    """The GPU image cannot be built here, so it must stay the CPU image's twin: the same steps in
    the same order, differing only in the base, the CPU image's system libraries and torch index,
    how the dependencies are installed (a venv with the `cpu` extra, or next to the base image's
    vLLM) and the CPU KV cache size."""
    gpu, cpu = DOCKER_DIR / "vllm.Dockerfile", DOCKER_DIR / "vllm-cpu.Dockerfile"
    cpu_only = {
        ("RUN", next(o for k, o in _instructions(cpu) if k == "RUN" and "apt-get" in o)),
        ("ARG", "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"),
    }
    gpu_steps = _instructions(gpu)
    cpu_steps = [step for step in _instructions(cpu) if step not in cpu_only]
    assert [k for k, _ in gpu_steps] == [k for k, _ in cpu_steps]
    allowed = {
        "ARG BASE_IMAGE=",  # the base
        "ENV PIP_NO_CACHE_DIR=1",  # the venv, or installing next to the system Python's vLLM
        "RUN python",  # the dependencies: the cpu extra, or the base dependencies
        "RUN if python3 -m pip",  # the package itself: pip or uv, or the venv's pip
        "ENV HIDDEN_STATE_PROXY_RING_DIR=",  # + VLLM_CPU_KVCACHE_SPACE
    }
    for (_, g), (_, c) in zip(gpu_steps, cpu_steps, strict=True):
        if g != c:
            assert any(g.startswith(p) for p in allowed), f"{g!r} differs from {c!r}"
    gpu_config, cpu_config = image_config(gpu), image_config(cpu)
    for key in ("entrypoint", "cmd"):
        assert gpu_config[key] == cpu_config[key]
    assert {k: v for k, v in cpu_config["env"].items() if k in gpu_config["env"]} == {
        k: v for k, v in gpu_config["env"].items() if k in cpu_config["env"]
    }
    assert set(cpu_config["env"]) - set(gpu_config["env"]) == {
        "VIRTUAL_ENV",
        "PATH",
        "VLLM_CPU_KVCACHE_SPACE",
    }
    hook_check = 'python -c "from importlib.metadata import entry_points; assert any'
    assert hook_check.replace("python ", "python3 ") in run_text(gpu)
    assert hook_check in run_text(cpu)


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
