"""The README's blocks as a newcomer without a GPU or a model hub runs them (tests/doc_blocks.py):

- the quick start, as written with ``--tiny-model`` (what the README tells them to add), on a
  server of its own: ``serve``, ``check``, the quick start's Python, which prints the first
  values of the sample answer shown below it, and that answer's request sent raw, whose JSON
  is the README's (its shape, info and first values);
- the hook-off line, as written on the tiny model (``--model "$(hidden-state-proxy
  build-tiny-model)"``, as the README says), on a vLLM of its own;
- the Python blocks one after another in one interpreter (the quick start, then the layers,
  embeddings, answer and matrix recipes, which use its ``client`` and ``MODEL``) against the
  shared stack, which captures the tiny model's equivalents of the README's layers.

The two servers of their own start in the own-server session (about a minute each on 2 cores).
The blocks that need a GPU, Docker or the network are checked in tests/test_doc_blocks.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.doc_blocks import (
    DOC_MODEL,
    DOC_URL,
    TINY_MODEL_PATH,
    TINY_SERVE_OPTION,
    commands,
    marked,
    on_tiny_model,
)
from tests.e2e.server import SHARED_LAYERS, STARTUP_TIMEOUT, RunningStack, stack_environment
from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    one_vllm_at_a_time,
    stop_process_group,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import TINY_MODEL_DIR_ENV


def environment(tiny_model_dir: Path | None = None) -> dict[str, str]:
    """An offline environment with this interpreter's bin directory first on PATH
    (``hidden-state-proxy``, ``python`` as installed beside it); the tiny model is the
    session's."""
    env = stack_environment()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if tiny_model_dir is not None:
        env[TINY_MODEL_DIR_ENV] = str(tiny_model_dir)
    return env


def on_port(text: str, port: int) -> str:
    """The README's URL (port 8000) moved to ``port``: a free one on a shared machine."""
    return text.replace(DOC_URL, f"http://127.0.0.1:{port}")


def wait_ready(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    try:
        wait_until_healthy(url, process, STARTUP_TIMEOUT)
    except NotHealthy as problem:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise AssertionError(f"{problem}; the end of its log:\n{tail}") from None


def run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"
    return done.stdout


# -- the shared stack ---------------------------------------------------------------------------


def test_the_python_blocks_run_in_order(stack: RunningStack, model_name: str) -> None:
    code = on_tiny_model("\n".join(block.code for block in marked("python")))
    assert SHARED_LAYERS == ("0", "1", "-1")  # the tiny model's layers the README gives
    code = code.replace(DOC_URL, stack.proxy_url).replace(DOC_MODEL, model_name)
    # What each recipe leaves behind, checked at the end.
    code += (
        "\nimport json\n"
        "print(json.dumps({'vector': list(vector.shape), 'info': states.info,"
        " 'by_layer': sorted(by_layer), 'vectors': [len(v) for v in vectors],"
        " 'answer': len(answer_vector), 'rows': list(rows.shape)}))\n"
    )
    result = json.loads(run_python(code, environment()).splitlines()[-1])
    hidden_size = result["info"]["hidden_size"]
    assert result["vector"] == [hidden_size]
    assert result["by_layer"] == sorted(int(layer) for layer in SHARED_LAYERS)  # as requested
    assert result["vectors"] == [hidden_size, hidden_size]
    assert result["answer"] == hidden_size
    assert result["rows"][1] == hidden_size and result["rows"][0] > 1


# -- the quick start, on a server of its own ----------------------------------------------------


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


@pytest.fixture
def quick_start(tiny_model_dir: Path, tmp_path: Path) -> Iterator[int]:
    """The quick start's serve line as written, with --tiny-model, on a free port: the port."""
    serve, _ = commands(marked("quick-start")[0].code)
    port = free_port()
    argv = [on_port(arg, port) for arg in serve]
    argv[argv.index("--port") + 1] = str(port)
    log_path = tmp_path / "serve.log"
    with one_vllm_at_a_time(), open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*argv, TINY_SERVE_OPTION],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment(tiny_model_dir),
            start_new_session=True,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", process, log_path)
            yield port
        finally:
            stop_process_group(process, "hidden-state-proxy serve", grace=60)


@pytest.mark.own_server
def test_the_quick_start_runs_as_written_and_answers_as_shown(
    quick_start: int, tiny_model_dir: Path
) -> None:
    env = environment(tiny_model_dir)
    _, check = commands(marked("quick-start")[0].code)
    done = subprocess.run(
        [on_port(arg, quick_start) for arg in check],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("passed:"), done.stdout

    shown = shown_response()
    shown_values = shown["kv_transfer_params"]["last_hidden_state"]
    # The quick start's Python, unchanged: it prints the shape and the first three values.
    printed = run_python(on_port(marked("python")[0].code, quick_start), env)
    match = re.fullmatch(r"\((\d+),\) \[(.*)\]\s*", printed, re.S)
    assert match, printed
    shape, values = match.groups()
    info = shown["kv_transfer_params"]["last_hidden_state_info"]
    assert int(shape) == info["hidden_size"]
    np.testing.assert_allclose([float(v) for v in values.split()], shown_values, rtol=1e-5)

    # The same request sent raw, as the README describes it: the JSON it shows.
    body = {
        "model": DOC_MODEL,
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
    url = f"http://127.0.0.1:{quick_start}/v1/chat/completions"
    real = httpx.post(url, json=body, timeout=120).json()
    same_shape(shown, real)
    assert real["model"] == shown["model"] == DOC_MODEL
    params = real["kv_transfer_params"]
    assert set(shown["kv_transfer_params"]) == set(params)
    assert params["last_hidden_state_info"] == info  # position, sizes, dtype, pooling, layer
    assert len(params["last_hidden_state"]) == info["hidden_size"]
    np.testing.assert_allclose(params["last_hidden_state"][:3], shown_values, rtol=1e-5)
    assert shown["usage"]["prompt_tokens"] == real["usage"]["prompt_tokens"]


# -- the hook-off line, on a vLLM of its own ----------------------------------------------------


@pytest.mark.own_server
def test_the_hook_off_line_serves_without_the_hook(tiny_model_dir: Path, tmp_path: Path) -> None:
    (block,) = marked("hook-off")
    port = free_port()
    # The tiny model as the README says, and a free port in place of vLLM's default 8000.
    line = block.code.strip().replace(DOC_MODEL, TINY_MODEL_PATH) + f" --port {port}"
    log_path = tmp_path / "vllm.log"
    with one_vllm_at_a_time(), open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", line],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment(tiny_model_dir),
            start_new_session=True,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", process, log_path)
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "model": str(tiny_model_dir),
                    "messages": [{"role": "user", "content": "Name a colour."}],
                    "max_completion_tokens": 1,
                    "kv_transfer_params": {"return_last_hidden_state": True},
                },
                timeout=120,
            )
        finally:
            stop_process_group(process, "vLLM", grace=60)
    assert answer.status_code == 200, answer.text
    assert "last_hidden_state" not in json.dumps(answer.json())
    log_text = log_path.read_text(errors="replace")
    assert "worker hook disabled by HIDDEN_STATE_PROXY_HOOK" in log_text
    assert "worker hook active" not in log_text
