"""The docs' code blocks, each marked by what the tests do with it.

Every fenced ``bash``, ``python`` or ``json`` block of README.md, docs/clients.md and
docs/extract.md follows a line ``<!-- doc-test: MARK -->``; :data:`MARKS` says what each mark
means and which test takes its blocks. A block without a known mark fails
tests/test_doc_blocks.py, so none is left untested by accident; the exceptions, the blocks that
are not run (:data:`NOT_RUN`), are marked as such.

The blocks run on the built-in tiny model (``serve --tiny-model``), as the README tells a reader
without a GPU or a model hub to run them. Where a block holds a value of Qwen3-0.6B's that the
tiny model lacks (a layer number, a token id), the docs give the tiny model's next to it, in the
block or in its section's text: :data:`TINY_EQUIVALENTS` are those pairs, which
:func:`on_tiny_model` puts in, and tests/test_doc_blocks.py fails when a doc no longer says one
where it uses it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLIENTS = ROOT / "docs" / "clients.md"
EXTRACT = ROOT / "docs" / "extract.md"
#: The documents whose blocks are marked, and run or checked.
DOCUMENTS = (README, CLIENTS, EXTRACT)

#: Every mark: what is done with its blocks, and by which test.
MARKS = {
    "github": "not run (installs from GitHub): the package, extras and repository are "
    "pyproject.toml's (tests/test_doc_blocks.py)",
    "docker-helm": "not run (Docker, a cluster): checked against compose.yaml, the chart and "
    "the Dockerfiles (tests/test_doc_blocks.py)",
    "llamaindex": "not run: LlamaIndex is not installed (it needs the OpenAI SDK 2)",
    "hook-off": "run on the tiny model, the hook off (tests/e2e/test_readme.py, its own vLLM)",
    "quick-start": "run with serve --tiny-model: serve, then check "
    "(tests/e2e/test_readme.py, its own vLLM)",
    "response": "the quick start's answer: its shape, info and first values are the real one's "
    "(tests/e2e/test_readme.py)",
    "python": "run against the shared e2e stack (the README's in order, in one interpreter: "
    "tests/e2e/test_readme.py; the others each in its own: tests/e2e/test_docs_examples.py)",
    "shell": "run with bash against the shared e2e stack (tests/e2e/test_docs_examples.py)",
    "corpus": "written as the corpus.jsonl that the commands beside it read "
    "(tests/e2e/test_docs_examples.py)",
    "manifest": "the keys of the manifest that the command above writes "
    "(tests/e2e/test_docs_examples.py)",
    "ray": "run against the shared e2e stack on a local Ray cluster of two nodes, moto's S3 "
    "server in the environment, its corpus put at its input (tests/e2e/test_mapper_ray.py)",
    "mapper": "run against the shared e2e stack (tests/e2e/test_mapper_ray.py)",
    "kubernetes": "not run (a cluster, S3): the Job it applies is checked offline "
    "(tests/deploy/test_deploy_extract_job.py)",
    "object-store": "run with bash against the shared e2e stack, moto's S3 server in the "
    "environment, the corpus block put at its INPUT (tests/e2e/test_extract_object_store.py)",
}
#: The marks of blocks that are not run: each is checked against what it names, or skipped.
NOT_RUN = ("github", "docker-helm", "llamaindex", "kubernetes")

#: The docs' values of Qwen3-0.6B (28 layers) and the tiny model's (2 layers, a vocabulary of
#: 640), each pair written in the docs next to where the first is used.
TINY_EQUIVALENTS = {
    "[8, 16, -1]": "[0, 1, -1]",
    '"layer": 16': '"layer": 1',
    "--layers 8,-1": "--layers 0,-1",
    "layer_28": "layer_2",
    "[785, 6722, 315, 9625, 374]": "[299, 603, 563, 633, 347]",
}
#: What the README tells a reader without a GPU or a model hub to add to ``serve``, and to give
#: a command that starts vLLM itself as its model (the tests do the same).
TINY_SERVE_OPTION = "--tiny-model"
TINY_MODEL_PATH = '"$(hidden-state-proxy build-tiny-model)"'
#: The server the docs' examples talk to, and the model name they send (the tests put their
#: stack's in).
DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = "Qwen/Qwen3-0.6B"

_FENCE = re.compile(
    r"(?:^<!-- doc-test: (?P<mark>[\w-]+) -->\n)?^```(?P<language>\w*)\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
_HEADING = re.compile(r"^#{1,6} .*$", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    mark: str | None
    language: str
    code: str
    path: Path
    #: The text of the section the block is in (from its heading to the next), blocks left out.
    section: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}: {self.language} block\n{self.code}"


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of ``path``, in order, with its mark (None without one)."""
    text = path.read_text(encoding="utf-8")
    fences = list(_FENCE.finditer(text))
    # A heading is a line starting with "#" outside every block (a shell comment is not one).
    inside = [(m.start(), m.end()) for m in fences]
    starts = [0] + [
        m.start()
        for m in _HEADING.finditer(text)
        if not any(begin <= m.start() < end for begin, end in inside)
    ]
    bounds = [*starts, len(text)]

    def section(position: int) -> str:
        index = max(i for i, start in enumerate(starts) if start <= position)
        return _FENCE.sub("", text[bounds[index] : bounds[index + 1]])

    return [
        Block(match["mark"], match["language"], match["code"], path, section(match.start()))
        for match in fences
    ]


def marked(mark: str, path: Path = README) -> list[Block]:
    return [block for block in blocks(path) if block.mark == mark]


def every_block() -> list[Block]:
    return [block for path in DOCUMENTS for block in blocks(path)]


def on_tiny_model(code: str) -> str:
    """``code`` with Qwen3-0.6B's values replaced by the tiny model's (:data:`TINY_EQUIVALENTS`)."""
    for qwen, tiny in TINY_EQUIVALENTS.items():
        code = code.replace(qwen, tiny)
    return code


def commands(code: str) -> list[list[str]]:
    """A shell block's commands as argv lists: comments dropped, ``\\`` continuations joined."""
    joined = code.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            found.append(argv)
    return found
