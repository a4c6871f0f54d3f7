"""``make demo``: the main job, offline, on the built-in tiny model.

Runs ``hidden-state-proxy serve Qwen/Qwen3-0.6B --tiny-model`` (the tiny random-weight chat
model, built if needed, under the docs' name), sends the README's quick-start request with the
official OpenAI client, prints the vector's length and first values (the README's sample
answer's), and stops everything. vLLM's own log goes to a file (its path is printed); the
console shows ``serve``'s progress lines, and the log's tail if something fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    log_tail,
    stop_process_group,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import TINY_MODEL_DIR_ENV

#: The name the docs use: the demo's request is the README's quick start.
SERVED_MODEL_NAME = "Qwen/Qwen3-0.6B"


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


#: Lines of the server's output shown on the console (the rest is in the log file).
_SHOWN = ("[hidden-state-proxy]", "worker hook", "Traceback", "ERROR")


def _relay(stream: IO[bytes], log: IO[bytes], quiet: threading.Event) -> None:
    """Copy the server's output to the log file; echo progress and error lines until ``quiet``
    (vLLM's shutdown logs alarming-looking errors when its engine is stopped)."""
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        line = raw.decode(errors="replace").rstrip()
        if not quiet.is_set() and any(marker in line for marker in _SHOWN):
            print("  " + line, flush=True)


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    try:
        wait_until_healthy(url, process, timeout)  # `serve` prints progress while vLLM loads
    except NotHealthy as problem:
        raise SystemExit(f"[demo] {problem}. Last lines of {log}:\n{log_tail(log)}") from None


def run_demo(model_dir: Path | None, timeout: float) -> int:
    port = free_port()  # vLLM gets serve's default: a private socket, no port
    # The README's quick start, on the built-in tiny model (`serve --tiny-model`: its options
    # are the tiny model's, in one place), under the name the docs use.
    command = [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "serve",
        SERVED_MODEL_NAME,
        "--tiny-model",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
    ]
    env = dict(os.environ)
    if model_dir is not None:
        env[TINY_MODEL_DIR_ENV] = str(model_dir)
    log_path = Path(tempfile.gettempdir()) / "vllm-hidden-state-proxy-demo.log"
    shown = "hidden-state-proxy " + " ".join(command[3:])
    _say(f"starting vLLM and the proxy (about a minute on CPU): {shown}")
    _say(f"vLLM's log: {log_path}")
    server = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    if server.stdout is None:  # cannot happen with stdout=PIPE; narrows the type
        raise RuntimeError("serve was started without a pipe for its output")
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed after the relay thread ends
    quiet = threading.Event()
    relay = threading.Thread(target=_relay, args=(server.stdout, log_file, quiet), daemon=True)
    relay.start()
    try:
        _wait_ready(f"http://127.0.0.1:{port}/health", server, timeout, log_path)
        from openai import OpenAI

        MODEL = SERVED_MODEL_NAME
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        response = client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": "Summarize this text in one word: "
                    "A yellow bicycle beside a stone wall.",
                }
            ],
            max_completion_tokens=1,
            n=1,
            stream=False,
            extra_body={
                "chat_template_kwargs": {"enable_thinking": False},
                "kv_transfer_params": {"return_last_hidden_state": True},
            },
        )
        vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
        print()
        print(f"  prompt tokens       : {response.usage.prompt_tokens if response.usage else '?'}")
        print(f"  generated text      : {response.choices[0].message.content!r}")
        print(f"  last_hidden_state   : {len(vector)} float32 values")
        print(f"  first values        : {[round(x, 5) for x in vector[:6]]}")
        print()
        _say("done; stopping the server")
        quiet.set()
        return 0
    finally:
        stop_process_group(server, "the server", grace=60)
        relay.join(timeout=10)
        log_file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"where the tiny model is (${TINY_MODEL_DIR_ENV})",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    sys.exit(run_demo(args.model_dir, args.timeout))


if __name__ == "__main__":
    main()
