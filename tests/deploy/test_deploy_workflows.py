"""The GitHub workflows (.github/workflows): actionlint on each (shellcheck on their scripts
where it is installed), the release tag checked against the package's version by the workflow's
own script, and the image names one fact across the workflow, compose.yaml and the chart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from tests.deploy.commands import CHART_DIR, COMPOSE_FILE, REPO, load_compose

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
IMAGES_WORKFLOW = REPO / ".github" / "workflows" / "images.yml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ACTIONLINT = Path(sys.executable).parent / "actionlint"
#: The published images (the issue's names), by the Dockerfile each is built from.
PUBLISHED = {
    "deploy/docker/proxy.Dockerfile": f"ghcr.io/vllm-hidden-state-proxy/proxy:{VERSION}",
    "deploy/docker/vllm.Dockerfile": f"ghcr.io/vllm-hidden-state-proxy/vllm:{VERSION}-gpu",
    "deploy/docker/vllm-cpu.Dockerfile": f"ghcr.io/vllm-hidden-state-proxy/vllm:{VERSION}-cpu",
}


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    # Without shellcheck on PATH actionlint skips the scripts' check; say so explicitly.
    shellcheck = [] if shutil.which("shellcheck") else ["-shellcheck="]
    return subprocess.run(
        [str(ACTIONLINT), "-no-color", *shellcheck, *map(str, paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def load_workflow(path: Path) -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(path.read_text())
    return loaded


def test_there_are_workflows() -> None:
    assert {p.name for p in WORKFLOWS} >= {"images.yml", "ci.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_actionlint_passes(path: Path) -> None:
    result = actionlint(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_can_fail(tmp_path: Path) -> None:
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    broken = load_workflow(IMAGES_WORKFLOW)
    broken["jobs"]["image"]["needs"] = "versoin"
    path = workflows / "images.yml"
    path.write_text(yaml.safe_dump(broken))
    result = actionlint(path)
    assert result.returncode == 1 and "versoin" in result.stdout, result.stdout


def image_steps() -> list[dict[str, Any]]:
    job = load_workflow(IMAGES_WORKFLOW)["jobs"]["image"]
    steps: list[dict[str, Any]] = [
        s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push-action@")
    ]
    return steps


def workflow_images() -> dict[str, str]:
    """Dockerfile -> the image it is pushed as, from the matrix and the build step's tags."""
    workflow = load_workflow(IMAGES_WORKFLOW)
    (build,) = image_steps()
    assert build["with"]["tags"] == (
        "${{ matrix.image }}:${{ needs.version.outputs.version }}${{ matrix.suffix }}"
    )
    assert build["with"]["file"] == "${{ matrix.dockerfile }}"
    include = workflow["jobs"]["image"]["strategy"]["matrix"]["include"]
    return {row["dockerfile"]: f"{row['image']}:{VERSION}{row['suffix']}" for row in include}


def test_the_workflow_pushes_the_published_images() -> None:
    assert workflow_images() == PUBLISHED
    for dockerfile in PUBLISHED:
        assert (REPO / dockerfile).is_file()


def test_the_workflow_runs_on_release_tags_and_may_push() -> None:
    workflow = load_workflow(IMAGES_WORKFLOW)
    # PyYAML reads the key `on` as True (YAML 1.1).
    triggers = workflow[True]
    assert triggers["push"] == {"tags": ["v*"]}
    assert "workflow_dispatch" in triggers
    assert workflow["permissions"] == {"contents": "read", "packages": "write"}
    (build,) = image_steps()
    assert build["with"]["context"] == "."  # the Dockerfiles' context (.dockerignore)
    assert "github.event_name == 'push'" in build["with"]["push"]
    uses = [s["uses"] for job in workflow["jobs"].values() for s in job["steps"] if "uses" in s]
    assert {u.split("@")[0] for u in uses} >= {
        "docker/setup-buildx-action",
        "docker/login-action",
        "docker/build-push-action",
    }
    for name in uses:
        assert name.split("@")[1].startswith("v"), f"{name}: pin at least the major version"


def run_version_step(tmp_path: Path, ref_type: str, ref_name: str) -> tuple[int, str]:
    """The version job's script, run with bash as the runner would, in the repository."""
    (step,) = [s for s in load_workflow(IMAGES_WORKFLOW)["jobs"]["version"]["steps"] if "run" in s]
    output = tmp_path / "github-output"
    output.write_text("")
    env = {
        **os.environ,
        "GITHUB_REF_TYPE": ref_type,
        "GITHUB_REF_NAME": ref_name,
        "GITHUB_OUTPUT": str(output),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", step["run"]], cwd=REPO, env=env, capture_output=True, text=True
    )
    return done.returncode, output.read_text() + done.stdout


def test_a_release_tag_must_be_the_packages_version(tmp_path: Path) -> None:
    assert run_version_step(tmp_path, "tag", f"v{VERSION}") == (0, f"version={VERSION}\n")
    assert run_version_step(tmp_path, "branch", "main") == (0, f"version={VERSION}\n")
    code, said = run_version_step(tmp_path, "tag", "v9.9.9")
    assert code == 1 and f"is not v{VERSION}" in said


def test_compose_defaults_are_the_published_images() -> None:
    services = load_compose({})["services"]
    by_dockerfile = {s["build"]["dockerfile"]: s["image"] for s in services.values()}
    assert by_dockerfile == PUBLISHED, COMPOSE_FILE


def chart_images(node: Any) -> list[tuple[str, str]]:
    """Every ``{repository, tag}`` in the chart's values, wherever the layout puts it."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        if isinstance(node.get("repository"), str) and "tag" in node:
            found.append((node["repository"], str(node["tag"] or "")))
        for value in node.values():
            found.extend(chart_images(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(chart_images(value))
    return found


def test_chart_defaults_are_the_published_images() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    images = chart_images(values)
    repositories = {repository for repository, _ in images}
    assert repositories == {name.split(":")[0] for name in PUBLISHED.values()}
    chart_runs = {PUBLISHED[f"deploy/docker/{name}.Dockerfile"] for name in ("vllm", "proxy")}
    for repository, tag in images:
        if tag:  # an empty tag is the chart's appVersion by convention
            assert f"{repository}:{tag}" in chart_runs, (repository, tag)
