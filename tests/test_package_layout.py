"""The house rules of issue #13 that code can check: no import cycles in ``src/`` (lazy imports
inside functions included), no module over 600 lines, and ``protocol.py`` (the facts both
processes agree on) importing nothing of the project; and that the package ships ``py.typed``
(the client module is typed for its users: docs/clients.md)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import vllm_hidden_state_proxy

PACKAGE_DIR = Path(vllm_hidden_state_proxy.__file__).parent
PACKAGE = PACKAGE_DIR.name
MAX_MODULE_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _project_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``path`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in modules:
                found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if f"{node.module}.{alias.name}" in modules
            )
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _project_imports(path, modules) - {name} for name, path in modules.items()}


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    # The checker must find real edges, or "no cycle" would prove nothing.
    assert f"{PACKAGE}.proxy.chat_app" in graph
    assert f"{PACKAGE}.protocol" in graph[f"{PACKAGE}.proxy.inspection"]


def test_no_import_cycles() -> None:
    try:
        tuple(TopologicalSorter(import_graph()).static_order())
    except CycleError as cycle:
        raise AssertionError(f"import cycle: {' -> '.join(cycle.args[1])}") from None


def test_no_module_over_600_lines() -> None:
    too_long = {
        name: length
        for name, path in _modules().items()
        if (length := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_protocol_imports_nothing_of_the_project() -> None:
    assert import_graph()[f"{PACKAGE}.protocol"] == set()


def test_the_wheel_ships_py_typed(tmp_path: Path) -> None:
    """``py.typed`` exists and is package data: a wheel built from the sources has it (a type
    checker ignores an installed package's types without it)."""
    assert (PACKAGE_DIR / "py.typed").is_file()
    root = PACKAGE_DIR.parents[1]
    tree = tmp_path / "tree"  # a copy: the build's egg-info and build/ stay out of the checkout
    shutil.copytree(root / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, tree / name)
    script = (
        "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=tree, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    assert f"{PACKAGE}/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_the_offline_api_imports_nothing_of_the_proxy() -> None:
    """``offline/`` runs in a user's script beside vLLM: what it shares with the proxy lives
    outside ``proxy/`` (``wanted_vectors.py``, ``request_fields.py``, ``protocol.py``), so a
    restructured proxy cannot break it, nor the proxy's dependencies burden it."""
    graph = import_graph()
    reached: set[str] = set()
    todo = [name for name in graph if name.startswith(f"{PACKAGE}.offline")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert not {name for name in reached if name.startswith(f"{PACKAGE}.proxy")}
    assert f"{PACKAGE}.wanted_vectors" in reached
