"""The README's code blocks, each marked by the test that runs or checks it.

Every fenced ``bash``, ``python`` or ``json`` block of README.md follows a line
``<!-- readme-test: NAME -->``: ``tests/test_readme.py`` checks the blocks that need a GPU,
Docker, a cluster or the network against the files they name (pyproject.toml, compose.yaml,
the chart's values), and ``tests/e2e/test_readme.py`` runs the others against the shared
test stack. A block without a mark fails the first, so none is left untested by accident.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: Every mark, and which test takes its blocks.
MARKS = {
    "install": "tests/test_readme.py",
    "hook-off": "tests/test_readme.py",
    "deploy": "tests/test_readme.py",
    "quick-start": "tests/e2e/test_readme.py",
    "python": "tests/e2e/test_readme.py",
    "response": "tests/e2e/test_readme.py",
}
_FENCE = re.compile(
    r"(?:^<!-- readme-test: (?P<mark>[\w-]+) -->\n)?^```(?P<language>\w*)\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    mark: str | None
    language: str
    code: str


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block, in order, with its mark (None without one)."""
    return [
        Block(match["mark"], match["language"], match["code"])
        for match in _FENCE.finditer(path.read_text(encoding="utf-8"))
    ]


def marked(mark: str, path: Path = README) -> list[Block]:
    return [block for block in blocks(path) if block.mark == mark]


def commands(code: str) -> list[list[str]]:
    """A shell block's commands as argv lists: comments dropped, ``\\`` continuations joined."""
    joined = code.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            found.append(argv)
    return found
