"""The blocks of docs/clients.md and docs/extract.md, run as written against the shared stack
(tests/doc_blocks.py: only the URL and the model name replaced, and Qwen3-0.6B's layer numbers
and token ids by the tiny model's, as the docs give them).

clients.md: each Python block in its own interpreter, each shell block with bash (curl).
extract.md: in a directory of its own, in the page's order: its inputs block written as the
``corpus.jsonl`` its commands read, the commands (a dataset of vectors, one of matrices), the
manifest they wrote against the one shown, then each loading snippet on the dataset it reads.
The README's run in tests/e2e/test_readme.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import (
    CLIENTS,
    DOC_MODEL,
    DOC_URL,
    EXTRACT,
    TINY_EQUIVALENTS,
    Block,
    marked,
    on_tiny_model,
)
from tests.e2e.server import RunningStack
from tests.e2e.test_readme import environment

CLIENT_BLOCKS = marked("python", CLIENTS) + marked("shell", CLIENTS)


def test_the_pages_have_their_examples() -> None:
    assert len(CLIENT_BLOCKS) == 6
    assert [b.mark for b in marked("shell", EXTRACT) + marked("python", EXTRACT)] == [
        "shell",
        "shell",
        "python",
        "python",
        "python",
    ]


def run_block(
    stack: RunningStack,
    model: str,
    block: Block,
    cwd: Path | None = None,
    extra_env: dict[str, str] | None = None,
    after: str = "",
) -> str:
    code = on_tiny_model(block.code).replace(DOC_URL, stack.proxy_url).replace(DOC_MODEL, model)
    code += after
    command = (
        [sys.executable, "-c", code]
        if block.language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    env = {**environment(), **(extra_env or {})}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=cwd
    )
    assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize(
    "block", CLIENT_BLOCKS, ids=[f"{i}-{b.language}" for i, b in enumerate(CLIENT_BLOCKS)]
)
def test_a_clients_example_runs(stack: RunningStack, model_name: str, block: Block) -> None:
    output = run_block(stack, model_name, block)
    if block.language != "bash":
        return
    if "od -A n -t f4" in block.code:  # the values decoded: four floats
        values = [float(v) for v in output.split()]
        assert len(values) == 4 and all(math.isfinite(v) for v in values), output
        return
    # the capture, then a flagged answer
    decoder = json.JSONDecoder()
    capture, end = decoder.raw_decode(output)
    answer, _ = decoder.raw_decode(output[end:].lstrip())
    assert capture["object"] == "hidden_state_capture"
    assert isinstance(answer["kv_transfer_params"]["last_hidden_state"], str)


def test_the_token_ids_are_the_tiny_models(tiny_model_dir: Path) -> None:
    """The tiny model's ids that extract.md gives are its reading of what Qwen3's ids say."""
    from transformers import AutoTokenizer

    tiny = json.loads(TINY_EQUIVALENTS["[785, 6722, 315, 9625, 374]"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.encode("The capital of France is") == tiny


def same_kind(shown: object, real: object, where: str) -> None:
    numbers = {int, float}
    assert type(shown) is type(real) or {type(shown), type(real)} <= numbers, where


def test_the_extract_page_runs_in_order(
    stack: RunningStack, model_name: str, tmp_path: Path
) -> None:
    (corpus,) = marked("corpus", EXTRACT)
    (tmp_path / "corpus.jsonl").write_text(on_tiny_model(corpus.code), encoding="utf-8")
    inputs = len(corpus.code.splitlines())
    vectors, matrices = marked("shell", EXTRACT)
    for command in (vectors, matrices):
        run_block(stack, model_name, command, cwd=tmp_path)
    manifest = json.loads((tmp_path / "states" / "_manifest.json").read_text())
    # The manifest shown (Qwen3-0.6B's, a longer run) has the real one's keys, and its run's,
    # each value of the same kind; what is in them is the model's and the run's.
    (block,) = marked("manifest", EXTRACT)
    shown = json.loads(block.code)
    assert set(shown) == set(manifest)
    (run,) = manifest["runs"]
    assert set(shown["runs"][0]) == set(run)
    for key in shown["runs"][0]:
        same_kind(shown["runs"][0][key], run[key], f"runs[0].{key}")
    for key in shown:
        same_kind(shown[key], manifest[key], key)
    assert manifest["model"] == model_name and manifest["layers"] == [0, 2]
    assert manifest["columns"] == {"layer_0": 0, "layer_2": 2}
    assert manifest["capture"]["object"] == shown["capture"]["object"]
    hidden_size = manifest["hidden_size"]

    load_vectors, load_matrices, load_with_datasets = marked("python", EXTRACT)
    found = json.loads(
        run_block(
            stack,
            model_name,
            load_vectors,
            cwd=tmp_path,
            after="\nprint(__import__('json').dumps([len(ids), *vectors.shape]))",
        )
    )
    assert found == [inputs, inputs, hidden_size]
    found = json.loads(
        run_block(
            stack,
            model_name,
            load_matrices,
            cwd=tmp_path,
            after="\nprint(__import__('json').dumps([*rows.shape, offsets.tolist()]))",
        )
    )
    rows, width, offsets = found
    assert width == hidden_size and len(offsets) == inputs + 1 and offsets[-1] == rows > inputs
    datasets_env = {
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    printed = run_block(stack, model_name, load_with_datasets, tmp_path, datasets_env)
    assert printed.strip().splitlines()[-1] == f"({hidden_size},)"
