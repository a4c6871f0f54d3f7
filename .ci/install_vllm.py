"""Install a vLLM release's GPU wheel into this interpreter's venv with some of its pins replaced.

    python .ci/install_vllm.py VERSION [NAME==VERSION ...] [-- PIP_ARGS ...]

Used by `make test-vllm-next`. A vLLM release may pin a dependency at a version no index holds
(vLLM 0.34.0 pins ``flashinfer-python==0.7.3``; PyPI has 0.7.2.post1 and 0.7.4), and pip cannot
override a ``==`` in a package's own metadata. So: vllm itself with ``--no-deps``, then every
requirement its metadata names for this platform (no extras), the ones named on the command line
replaced, in one pip call with PIP_ARGS (the checkout, ``-e .[dev]``). pip then warns that vllm
wants the pinned version: that warning is the replacement, said out loud, not an error.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--progress-bar", "off", *args]
    print("[install_vllm]", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def main(argv: list[str]) -> int:
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    version, overrides = argv[0], argv[1:]
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
    _pip(*wanted, *rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
