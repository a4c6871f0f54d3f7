"""The vLLM 0.34 venv's cache key (.ci/install_vllm.py ``key``): every input that decides the
venv's contents changes it, and nothing else does, so a cached venv never hides a change."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _install_vllm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_vllm", ROOT / ".ci" / "install_vllm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install_vllm = _install_vllm()
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIP_ARGS = ["-e", ".[test]"]


def key(
    pyproject: dict[str, Any] = PYPROJECT,
    *,
    version: str = "0.34.0",
    overrides: tuple[str, ...] = ("flashinfer-python==0.7.4",),
    pip_args: list[str] = PIP_ARGS,
    script: bytes = b"script",
    python: str = "3.11",
    pip_configuration: dict[str, Any] | None = None,
) -> str:
    inputs = install_vllm.key_inputs(
        version,
        overrides,
        pip_args,
        pyproject=pyproject,
        script=script,
        python=python,
        pip_configuration=pip_configuration or {"settings": [], "constraints": {}},
    )
    return str(install_vllm.key_of(inputs))


def edited(change: Any) -> dict[str, Any]:
    pyproject = copy.deepcopy(PYPROJECT)
    change(pyproject["project"])
    return pyproject


def test_the_key_is_stable() -> None:
    assert key() == key()
    assert len(key()) == install_vllm.KEY_DIGITS


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda p: p["optional-dependencies"]["test"].append("pytest-xdist"), id="test extra"
        ),
        pytest.param(
            lambda p: p["optional-dependencies"]["test"].__setitem__(0, "pytest>=9"), id="test pin"
        ),
        pytest.param(lambda p: p["dependencies"].append("rich"), id="base dependency"),
        pytest.param(lambda p: p.__setitem__("requires-python", ">=3.12"), id="requires-python"),
    ],
)
def test_a_pin_the_venv_installs_changes_the_key(change: Any) -> None:
    assert key(edited(change)) != key()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p: p["optional-dependencies"]["dev"].append("rich"), id="dev extra"),
        pytest.param(lambda p: p.__setitem__("version", "9.9.9"), id="version"),
        pytest.param(lambda p: p.__setitem__("description", "x"), id="description"),
    ],
)
def test_what_the_venv_does_not_install_leaves_the_key(change: Any) -> None:
    assert key(edited(change)) == key()


def test_an_extra_named_by_an_installed_extra_counts() -> None:
    """``dev`` names ``vllm-hidden-state-proxy[test]``: installing dev installs test's pins."""
    args = ["-e", ".[dev]"]
    change = edited(lambda p: p["optional-dependencies"]["test"].append("pytest-xdist"))
    assert key(change, pip_args=args) != key(pip_args=args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"version": "0.33.0"},
        {"overrides": ()},
        {"pip_args": ["-e", ".[dev]"]},
        {"script": b"another script"},
        {"python": "3.12"},
        {
            "pip_configuration": {
                "settings": ["global.constraint='/c'"],
                "constraints": {"/c": "torch<=2.14.1"},
            }
        },
    ],
    ids=[
        "vllm version",
        "overrides",
        "pip arguments",
        "install script",
        "python",
        "pip constraints",
    ],
)
def test_every_other_input_changes_the_key(kwargs: dict[str, Any]) -> None:
    assert key(**kwargs) != key()


def test_an_unknown_extra_is_refused() -> None:
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        key(pip_args=["-e", ".[nope]"])


def test_the_makefile_names_the_venv_by_its_key() -> None:
    """``make next-venv`` prints the venv ``make test-vllm-next`` uses: its name ends with the
    key of this checkout's inputs, as the script computes it."""
    printed = subprocess.run(
        ["make", "--no-print-directory", "-s", "next-venv", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    computed = subprocess.run(
        [
            sys.executable,
            ".ci/install_vllm.py",
            "key",
            "0.34.0",
            "flashinfer-python==0.7.4",
            "--",
            *PIP_ARGS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert printed.endswith(f"-{computed}"), (printed, computed)


def test_prune_removes_only_the_same_venvs_other_keys(tmp_path: Path) -> None:
    keep = tmp_path / "venv-vllm-0.34.0-py3.11-aaaaaaaaaaaa"
    stale = tmp_path / "venv-vllm-0.34.0-py3.11-bbbbbbbbbbbb"
    other_version = tmp_path / "venv-vllm-0.33.0-py3.11-cccccccccccc"
    unkeyed = tmp_path / "venv-vllm-0.34.0-py3.11"
    for path in (keep, stale, other_version, unkeyed):
        path.mkdir()
    assert install_vllm.prune(tmp_path, keep) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (keep, other_version, unkeyed)
    )
