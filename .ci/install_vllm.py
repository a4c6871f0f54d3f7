"""Install a vLLM release's GPU wheel into this interpreter's venv with some of its pins replaced,
and name that venv by everything that decides its contents.

    python .ci/install_vllm.py install VERSION [NAME==VERSION ...] [-- PIP_ARGS ...]
    python .ci/install_vllm.py key VERSION [NAME==VERSION ...] [-- PIP_ARGS ...]
    python .ci/install_vllm.py prune DIRECTORY KEEP

Used by `make test-vllm-next`.

``install``: a vLLM release may pin a dependency at a version no index holds (vLLM 0.34.0 pins
``flashinfer-python==0.7.3``; PyPI has 0.7.2.post1 and 0.7.4), and pip cannot override a ``==``
in a package's own metadata. So: vllm itself with ``--no-deps``, then every requirement its
metadata names for this platform (no extras), the ones named on the command line replaced, in one
pip call with PIP_ARGS (the checkout, ``-e .[test]``). pip then warns that vllm wants the pinned
version: that warning is the replacement, said out loud, not an error.

``key``: prints the cache key of such a venv (12 hex digits), a digest of what decides what it
holds: this script, the version, the replaced pins, PIP_ARGS, the Python version, pip's own
configuration (its indexes and constraint files, with the files' contents), and the parts of
``pyproject.toml`` that PIP_ARGS installs (``requires-python``, the base dependencies and every
extra named, with the extras those name in turn). The Makefile puts the key in the venv's path,
so a change to any of them makes another venv and a cached one never hides it.

``prune``: removes the venvs in DIRECTORY that share KEEP's name up to its key (same vLLM version
and Python) but are not KEEP: they are out of date, and each is about 9.5 GB.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import requires
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The package's own name, as its extras name it when they name each other.
PACKAGE = "vllm-hidden-state-proxy"
KEY_DIGITS = 12


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--progress-bar", "off", *args]
    print("[install_vllm]", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        return argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    return argv, []


def install(version: str, overrides: Sequence[str], pip_args: Sequence[str]) -> int:
    _pip("packaging")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    replace = {canonicalize_name(Requirement(o).name): o for o in overrides}
    _pip("--no-deps", f"vllm=={version}")
    wanted: list[str] = []
    seen: set[str] = set()
    for line in requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in replace:
            print(f"[install_vllm] vllm {version} asks for {req}; installing {replace[name]}")
            seen.add(name)
            wanted.append(replace[name])
        else:
            wanted.append(str(req).split(";")[0].strip())
    unused = sorted(set(replace) - seen)
    if unused:
        print(f"[install_vllm] vllm {version} does not ask for {unused}", file=sys.stderr)
        return 2
    _pip(*wanted, *pip_args)
    return 0


# --------------------------------------------------------------------------------------------------
# The cache key


def extras_named(pip_args: Iterable[str]) -> list[str]:
    """The extras of this checkout that PIP_ARGS install (``-e .[a,b]`` gives ``[a, b]``)."""
    named: list[str] = []
    for arg in pip_args:
        match = re.fullmatch(r"""["']?\.(?:/)?\[([^\]]*)\]["']?""", arg.strip())
        if match:
            named += [extra.strip() for extra in match.group(1).split(",") if extra.strip()]
    return named


def extra_closure(optional: dict[str, list[str]], extras: Iterable[str]) -> list[str]:
    """``extras`` and every extra they name in turn (``vllm-hidden-state-proxy[test]``)."""
    todo, found = list(extras), []
    while todo:
        extra = todo.pop(0)
        if extra in found:
            continue
        if extra not in optional:
            raise SystemExit(f"[install_vllm] pyproject.toml has no extra {extra!r}")
        found.append(extra)
        for requirement in optional[extra]:
            own = re.match(rf"\s*{re.escape(PACKAGE)}\s*\[([^\]]*)\]", requirement)
            if own:
                todo += [name.strip() for name in own.group(1).split(",")]
    return found


def installed_requirements(pyproject: dict[str, Any], extras: Iterable[str]) -> dict[str, Any]:
    """What of ``pyproject`` decides a venv that installs this checkout with ``extras``."""
    project = pyproject["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    closure = extra_closure(optional, extras)
    return {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "extras": {extra: optional[extra] for extra in sorted(closure)},
    }


def _pip_configuration() -> dict[str, Any]:
    """pip's settings that steer a resolution (indexes, constraints), constraint files read."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    settings = sorted(
        line
        for line in listed.splitlines()
        if re.search(r"\.(index-url|extra-index-url|find-links|constraint|no-index)=", line)
    )
    constraints: dict[str, str] = {}
    for line in settings:
        if ".constraint=" in line:
            for name in line.split("=", 1)[1].strip("'\"").split():
                path = Path(name)
                constraints[name] = path.read_text() if path.is_file() else "<missing>"
    return {"settings": settings, "constraints": constraints}


def key_inputs(
    version: str,
    overrides: Sequence[str],
    pip_args: Sequence[str],
    *,
    pyproject: dict[str, Any],
    script: bytes,
    python: str,
    pip_configuration: dict[str, Any],
) -> dict[str, Any]:
    return {
        "script": hashlib.sha256(script).hexdigest(),
        "vllm": version,
        "overrides": list(overrides),
        "pip_args": list(pip_args),
        "python": python,
        "pip": pip_configuration,
        "pyproject": installed_requirements(pyproject, extras_named(pip_args)),
    }


def key_of(inputs: dict[str, Any]) -> str:
    encoded = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:KEY_DIGITS]


def checkout_key_inputs(
    version: str, overrides: Sequence[str], pip_args: Sequence[str]
) -> dict[str, Any]:
    import tomllib

    return key_inputs(
        version,
        overrides,
        pip_args,
        pyproject=tomllib.loads((ROOT / "pyproject.toml").read_text()),
        script=Path(__file__).read_bytes(),
        python=f"{sys.version_info[0]}.{sys.version_info[1]}",
        pip_configuration=_pip_configuration(),
    )


def prune(directory: Path, keep: Path) -> list[Path]:
    """Remove the venvs in ``directory`` named like ``keep`` but for the key; return them."""
    stem = keep.name[: -KEY_DIGITS - 1]
    removed = []
    for other in sorted(directory.glob(f"{stem}-*")):
        if other.name != keep.name and re.fullmatch(
            rf"[0-9a-f]{{{KEY_DIGITS}}}", other.name[-KEY_DIGITS:]
        ):
            print(f"[install_vllm] removing the out-of-date venv {other}", flush=True)
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    return removed


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("install", "key", "prune"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "prune":
        directory, keep = Path(rest[0]), Path(rest[1])
        prune(directory, keep)
        return 0
    head, pip_args = _split(rest)
    version, overrides = head[0], head[1:]
    if command == "key":
        inputs = checkout_key_inputs(version, overrides, pip_args)
        print(key_of(inputs))
        return 0
    status = install(version, overrides, pip_args)
    if status == 0:
        inputs = checkout_key_inputs(version, overrides, pip_args)
        (Path(sys.prefix) / ".install-key.json").write_text(
            json.dumps({"key": key_of(inputs), **inputs}, indent=2, sort_keys=True)
        )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
