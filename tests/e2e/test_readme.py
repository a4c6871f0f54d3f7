"""The README's commands against the shared stack, as a newcomer would run them: ``check``, then
the Python blocks one after another in one interpreter (the quick start, then the layers,
embeddings, answer and matrix recipes, which use its ``client`` and ``MODEL``), and the response
JSON it shows, against the answer to the same request now.

The shared stack is ``serve`` of the tiny model, so what the README names for a real model is
replaced, each replacement listed in :data:`REPLACED` (a test fails when one no longer matches,
so the list stays the README's). The commands that need a GPU, Docker or the network are
checked in tests/test_readme.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.server import SHARED_LAYERS, RunningStack
from tests.readme import commands, marked

README_URL = "http://127.0.0.1:8000"
README_MODEL = "Qwen/Qwen3-0.6B"
#: The README's layers of a 28-layer model, and the shared stack's (the tiny model has two).
REPLACED = {
    "[8, 16, -1]": "[" + ", ".join(SHARED_LAYERS) + "]",
    '"layer": 16': '"layer": 1',
}


def readme_text(code: str, stack: RunningStack, model: str) -> str:
    return code.replace(README_URL, stack.proxy_url).replace(README_MODEL, model)


def environment() -> dict[str, str]:
    """This interpreter's bin directory first: ``hidden-state-proxy`` as installed beside it."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_check_passes(stack: RunningStack, model_name: str) -> None:
    (_, check) = commands(marked("quick-start")[0].code)
    argv = [readme_text(arg, stack, model_name) for arg in check]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=environment(), check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("passed:"), done.stdout


def test_the_python_blocks_run_in_order(stack: RunningStack, model_name: str) -> None:
    code = "\n".join(block.code for block in marked("python"))
    for readme, here in REPLACED.items():
        assert readme in code, f"the README no longer has {readme}: update REPLACED"
        code = code.replace(readme, here)
    code = readme_text(code, stack, model_name)
    # What each recipe leaves behind, checked at the end.
    code += (
        "\nimport json\n"
        "print(json.dumps({'vector': list(vector.shape), 'info': states.info,"
        " 'by_layer': sorted(by_layer), 'vectors': [len(v) for v in vectors],"
        " 'answer': len(answer_vector), 'rows': list(rows.shape)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    hidden_size = result["info"]["hidden_size"]
    assert result["vector"] == [hidden_size]
    assert result["by_layer"] == sorted(int(layer) for layer in SHARED_LAYERS)  # as requested
    assert result["vectors"] == [hidden_size, hidden_size]
    assert result["answer"] == hidden_size
    assert result["rows"][1] == hidden_size and result["rows"][0] > 1


def shown_response() -> dict[str, Any]:
    """The README's JSON, its ``...`` trims taken out."""
    (block,) = marked("response")
    text = re.sub(r",\s*\.\.\.", "", block.code)
    shown: dict[str, Any] = json.loads(text)
    return shown


def same_shape(shown: Any, real: Any, where: str = "") -> None:
    """Every key the README shows is in the real answer, with a value of the same kind; lists
    are compared by their first item (the README trims them)."""
    if isinstance(shown, dict):
        assert isinstance(real, dict), where
        for key, value in shown.items():
            assert key in real, f"the real answer has no {where}.{key}"
            same_shape(value, real[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(real, list) and real, where
        same_shape(shown[0], real[0], f"{where}[0]")
    else:
        assert type(shown) is type(real) or {type(shown), type(real)} <= {int, float}, where


def test_the_response_shown_is_the_answers_shape(stack: RunningStack, model_name: str) -> None:
    """The request the README describes, sent raw; the README's JSON has its shape, and its
    info block is the real one's but for the numbers that depend on the model."""
    shown = shown_response()
    body = {
        "model": model_name,
        "messages": [
            {
                "role": "user",
                "content": "Summarize this text in one word: A yellow bicycle beside a stone wall.",
            }
        ],
        "max_completion_tokens": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "kv_transfer_params": {"return_last_hidden_state": True, "last_hidden_state_info": True},
    }
    real = httpx.post(f"{stack.proxy_url}/v1/chat/completions", json=body, timeout=120).json()
    same_shape(shown, real)
    params = real["kv_transfer_params"]
    assert len(params["last_hidden_state"]) == params["last_hidden_state_info"]["hidden_size"]
    assert set(shown["kv_transfer_params"]) == set(params)
    assert set(shown["kv_transfer_params"]["last_hidden_state_info"]) == set(
        params["last_hidden_state_info"]
    )
    # The README's numbers are the tiny model's, taken from this same request.
    assert (
        shown["kv_transfer_params"]["last_hidden_state_info"]["hidden_size"]
        == (params["last_hidden_state_info"]["hidden_size"])
    )
    assert shown["usage"]["prompt_tokens"] == real["usage"]["prompt_tokens"]
