"""The house rules of issues #13 and #45 that code can check: no import cycles in ``src/`` (lazy
imports inside functions included), no module over 600 lines, every module opening with its
reason, and ``protocol.py`` (the facts both processes agree on) importing nothing of the
project; ``proxy/`` in families (at most 24 entries at its top, only the commands that run it
importing it, its errors built in ``errors.py``, its ``types.py`` holding aliases only); and
that the package ships ``py.typed`` (the client module is typed for its users:
docs/clients.md)."""

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
#: Files and folders at the top of ``proxy/`` (``__init__.py`` included): past this, a family
#: of modules becomes a subpackage.
MAX_PROXY_ENTRIES = 24
#: The rooms that may import ``proxy/``: the commands that run it (``serve``'s options take the
#: proxy's table) and the benchmark. ``extract``, ``check`` and the client talk HTTP through
#: ``transport/`` or their own client instead.
PROXY_IMPORTERS = {"cli", "serve", "serve_options", "check", "bench", "proxy"}


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
    assert f"{PACKAGE}.proxy.endpoints" in graph
    assert f"{PACKAGE}.protocol" in graph[f"{PACKAGE}.proxy.inspection"]
    assert f"{PACKAGE}.transport" in graph[f"{PACKAGE}.extract.runner"]


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


def test_every_module_opens_with_its_reason() -> None:
    bare = [
        name
        for name, path in _modules().items()
        if not ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    ]
    assert not bare, f"modules without a docstring: {bare}"


def test_proxy_has_at_most_24_entries_at_its_top() -> None:
    entries = [p.name for p in (PACKAGE_DIR / "proxy").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= MAX_PROXY_ENTRIES, sorted(entries)


def test_only_the_commands_that_run_it_and_bench_import_proxy() -> None:
    importers = {
        name.split(".")[1]
        for name, imports in import_graph().items()
        if any(i == f"{PACKAGE}.proxy" or i.startswith(f"{PACKAGE}.proxy.") for i in imports)
    }
    assert importers <= PROXY_IMPORTERS, importers - PROXY_IMPORTERS


def _calls_of(path: Path, name: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_the_proxys_errors_are_built_in_errors_py() -> None:
    """Every ``ProxyError(...)`` is made by a factory of ``errors.py``, which names the fix."""
    built = {
        name: lines
        for name, path in _modules().items()
        if name.startswith(f"{PACKAGE}.proxy.")
        and name != f"{PACKAGE}.proxy.errors"
        and (lines := _calls_of(path, "ProxyError"))
    }
    assert not built, f"ProxyError built outside errors.py (module: lines): {built}"


def test_proxy_types_holds_aliases_only() -> None:
    """One home per name: ``types.py`` defines aliases and imports nothing of the project (the
    others import each project name from where it is defined)."""
    path = PACKAGE_DIR / "proxy" / "types.py"
    body = ast.parse(path.read_text()).body
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(PACKAGE):
            continue  # the standard library's names its aliases are made of
        assert isinstance(node, (ast.Assign, ast.AnnAssign)), ast.dump(node)


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


#: What the engines beyond one machine bring (issue #48): extract's mapper and storage use them
#: or are called by them; the proxy and the client module never import them.
_ENGINES = {"ray", "datasets", "fsspec", "s3fs", "gcsfs", "adlfs"}


def _third_party_imports(path: Path) -> set[str]:
    """The top names of everything ``path`` imports, wherever the statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_the_proxy_and_the_client_import_no_engine_nor_object_store() -> None:
    """Ray, datasets and fsspec: not in proxy/ or client/, nor in any module they import."""
    graph, modules = import_graph(), _modules()
    roots = [n for n in modules if n.startswith((f"{PACKAGE}.proxy", f"{PACKAGE}.client"))]
    reached, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    assert f"{PACKAGE}.extract.mapper" not in reached
    assert f"{PACKAGE}.extract.storage" not in reached
    bad = {
        name: found for name in reached if (found := _third_party_imports(modules[name]) & _ENGINES)
    }
    assert not bad, bad
