"""Helpers of the offline deployment tests: the values sets and accessors for rendered objects."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from pathlib import Path
from typing import Any

from tests.deploy.commands import CHART_DIR, REPO

#: Values sets the chart is checked with: the defaults and every file under ci/.
VALUES_FILES: dict[str, Path | None] = {"default": None} | {
    path.name.removesuffix("-values.yaml"): path
    for path in sorted((CHART_DIR / "ci").glob("*.yaml"))
}


def objects_of(manifests: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [doc for docs in manifests.values() for doc in docs]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in objects if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(manifests: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    spec: dict[str, Any] = only(objects_of(manifests), "Deployment")["spec"]["template"]["spec"]
    return spec


def container(manifests: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    containers = {c["name"]: c for c in pod_spec(manifests)["containers"]}
    assert set(containers) == {"vllm", "proxy"}, set(containers)
    found: dict[str, Any] = containers[name]
    return found


def env_of(container_spec: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or the valueFrom object)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env", [])}


def argv_of(container_spec: dict[str, Any]) -> list[str]:
    return [str(x) for x in container_spec.get("command", []) + container_spec.get("args", [])]


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of ``flag`` (``--flag value`` or ``--flag=value``); None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# ---------------------------------------------------------------------------------------------
# Dockerfiles


def declared_args(dockerfile: Path) -> dict[str, str | None]:
    """Every ARG of a Dockerfile, all stages and before the first FROM: name -> default (None
    without one). A build argument nobody declares is ignored with a warning."""
    import dockerfile as dockerfile_parser

    args: dict[str, str | None] = {}
    for command in dockerfile_parser.parse_file(str(dockerfile)):
        if command.cmd.upper() == "ARG":
            name, equals, default = command.value[0].partition("=")
            if args.get(name) not in (None, default if equals else None):
                raise AssertionError(f"{dockerfile.name}: ARG {name} has two defaults")
            args[name] = default if equals else None
    return args


# ---------------------------------------------------------------------------------------------
# The Docker build context (repository root filtered by .dockerignore)


def dockerignore_rules() -> list[str]:
    text = (REPO / ".dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def dockerignore_ignores(path: str, rules: list[str]) -> bool:
    """Docker's .dockerignore semantics, enough for this file: the last matching rule wins; a
    pattern matches the path or any parent directory of it."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").strip("/")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*")
        if pattern.startswith("**/"):
            regex = "(.*/)?" + fnmatch.translate(pattern[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def copy_docker_context(destination: Path) -> Path:
    """Copy what `docker build .` would send (the files .dockerignore lets through)."""
    rules = dockerignore_rules()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _NEVER_SENT]
        for name in files:
            path = Path(root) / name
            relative = path.relative_to(REPO).as_posix()
            if not dockerignore_ignores(relative, rules):
                target = destination / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    return destination


#: Directories not walked at all (large, and ignored by .dockerignore's leading `*`).
_NEVER_SENT = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
