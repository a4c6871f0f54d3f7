"""The README's commands that need a GPU, Docker, a cluster or the network, checked against what
they name: the pip line's package, extras and repository (pyproject.toml), the variable that
switches the hook off, compose's profiles and cache directory, the Helm ``--set`` keys and the
images built and pushed. (tests/e2e/test_readme.py runs the rest against a real server.)"""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

import yaml
from packaging.requirements import Requirement

from tests.readme import MARKS, README, blocks, commands, marked
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV
from vllm_hidden_state_proxy.worker_hook.settings import hook_mode

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = README.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PROJECT["urls"]["Repository"]
CHART = ROOT / "deploy" / "helm" / "vllm-hidden-state"


def test_every_block_is_marked() -> None:
    for block in blocks():
        if block.language in ("bash", "python", "json"):
            assert block.mark in MARKS, f"a README block has no known mark:\n{block.code}"
    for mark in MARKS:
        assert marked(mark), f"no README block is marked {mark}"


def test_the_install_line_names_this_repository_and_package() -> None:
    ((pip, install, spec),) = commands(marked("install")[0].code)
    assert (pip, install) == ("pip", "install")
    requirement = Requirement(spec)
    assert requirement.name == PROJECT["name"]
    assert requirement.url == f"git+{REPOSITORY}"


def test_the_extras_the_readme_names_exist() -> None:
    text = README.read_text()
    named = re.findall(rf"{PROJECT['name']}\[([\w,]+)\]", text)
    assert named
    extras = {extra for group in named for extra in group.split(",")}
    assert extras <= set(PROJECT["optional-dependencies"]), extras


def test_the_hook_off_line_switches_the_hook_off() -> None:
    ((assignment, *vllm),) = commands(marked("hook-off")[0].code)
    name, _, value = assignment.partition("=")
    assert name == HOOK_ENABLED_ENV
    assert hook_mode(value) == "off"
    assert vllm[:2] == ["vllm", "serve"]


def deploy_commands() -> list[list[str]]:
    (block,) = marked("deploy")
    return commands(block.code)


def option_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_compose_lines() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    profiles = {p for service in compose["services"].values() for p in service["profiles"]}
    lines = [argv for argv in deploy_commands() if argv[:2] == ["docker", "compose"]]
    assert lines
    for argv in lines:
        assert set(option_values(argv, "--profile")) <= profiles
    (mkdir,) = [argv for argv in deploy_commands() if argv[0] == "mkdir"]
    # The cache directory compose binds by default, which must exist.
    assert "${HF_CACHE:-${HOME}/.cache/huggingface}" in (ROOT / "compose.yaml").read_text()
    assert mkdir == ["mkdir", "-p", "~/.cache/huggingface"]


def value_at(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for key in dotted.split("."):
        assert isinstance(node, dict) and key in node, f"values.yaml has no {dotted}"
        node = node[key]
    return node


def test_helm_lines_set_keys_the_chart_has() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    installs = [argv for argv in deploy_commands() if argv[:2] == ["helm", "install"]]
    assert len(installs) == 2
    for argv in installs:
        assert (ROOT / argv[3]).resolve() == CHART
        for setting in option_values(argv, "--set"):
            key, _, _ = setting.partition("=")
            value_at(values, key)


def test_your_own_registry_lines_fit_together() -> None:
    """What is built is pushed, and is what the chart then runs: the --set repositories with
    the chart's default tags; each Dockerfile built is the published image's of that name."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = deploy_commands()
    built = {}
    for argv in lines:
        if argv[:2] == ["docker", "build"]:
            (dockerfile,) = option_values(argv, "-f")
            (tag,) = option_values(argv, "-t")
            assert (ROOT / dockerfile).is_file() and argv[-1] == "."
            built[tag] = dockerfile
    pushed = {argv[2] for argv in lines if argv[:2] == ["docker", "push"]}
    assert pushed == set(built)
    (own,) = [
        argv for argv in lines if any(s.startswith("image.") for s in option_values(argv, "--set"))
    ]
    settings = dict(s.split("=", 1) for s in option_values(own, "--set"))
    for name, dockerfile in (("vllm", "vllm.Dockerfile"), ("proxy", "proxy.Dockerfile")):
        repository = settings[f"image.{name}.repository"]
        tag = value_at(values, f"image.{name}.tag")
        assert built[f"{repository}:{tag}"] == f"deploy/docker/{dockerfile}"


def test_the_quick_start_lines_agree() -> None:
    """serve's port is the one check and the Python example use."""
    ((serve), (check)) = commands(marked("quick-start")[0].code)
    assert serve[:2] == ["hidden-state-proxy", "serve"]
    port = option_values(serve, "--port")[0]
    assert check[:2] == ["hidden-state-proxy", "check"]
    assert option_values(check, "--url") == [f"http://127.0.0.1:{port}"]
    python = marked("python")[0].code
    assert f'base_url="http://127.0.0.1:{port}/v1"' in python
    assert f'MODEL = "{serve[2]}"' in python


def test_commands_parse() -> None:
    for mark in ("install", "hook-off", "quick-start", "deploy"):
        for block in marked(mark):
            for line in block.code.replace("\\\n", " ").splitlines():
                shlex.split(line, comments=True)


def test_the_performance_figure_is_the_benchs() -> None:
    assert "](docs/figures/bench-latency.png)" in README.read_text()


def test_contributor_material_is_in_contributing() -> None:
    text = README.read_text()
    assert "make test " not in text and "## Two commands" not in text
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "make test" in contributing and ".ci/run" in contributing
