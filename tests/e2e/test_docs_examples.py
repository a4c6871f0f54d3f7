"""The examples of docs/clients.md, run as written against the shared stack (only the URL and
the model name replaced): each Python block in its own interpreter, each shell block with bash
(curl). The README's run in tests/e2e/test_readme.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import RunningStack

ROOT = Path(__file__).resolve().parents[2]
DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = "Qwen/Qwen3-0.6B"
#: The first line of an example the tests cannot run (its library is not installed here).
NOT_RUN = "# not run by the tests"
_BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(path.read_text())]


CLIENT_BLOCKS = [
    (language, code)
    for language, code in blocks(ROOT / "docs" / "clients.md")
    if not code.startswith(NOT_RUN) and "pip install" not in code
]


def test_the_page_has_its_examples() -> None:
    skipped = [code for _, code in blocks(ROOT / "docs" / "clients.md") if code.startswith(NOT_RUN)]
    assert len(skipped) == 1 and "llama_index" in skipped[0]
    assert len(CLIENT_BLOCKS) >= 5


def run_block(stack: RunningStack, model: str, language: str, code: str) -> str:
    code = code.replace(DOC_URL, stack.proxy_url).replace(DOC_MODEL, model)
    command = (
        [sys.executable, "-c", code]
        if language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=dict(os.environ)
    )
    assert done.returncode == 0, f"{language} example failed:\n{code}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize(
    ("language", "code"),
    CLIENT_BLOCKS,
    ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(CLIENT_BLOCKS)],
)
def test_a_clients_example_runs(
    stack: RunningStack, model_name: str, language: str, code: str
) -> None:
    output = run_block(stack, model_name, language, code)
    if language == "bash":  # the curl example: the capture, then a flagged answer
        decoder = json.JSONDecoder()
        capture, end = decoder.raw_decode(output)
        answer, _ = decoder.raw_decode(output[end:].lstrip())
        assert capture["object"] == "hidden_state_capture"
        assert isinstance(answer["kv_transfer_params"]["last_hidden_state"], str)
