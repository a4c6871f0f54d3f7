"""A vLLM ``LLM`` in a process of its own, driven by the tests through the offline API.

An offline ``LLM`` is a vLLM instance: its environment (the model runner, the hook's settings,
interpreted Triton for V2) is fixed when it is created and read by the engine processes it
spawns, and vLLM keeps process-wide state (its ``envs`` cache, Triton's backends) that a second
``LLM`` of another runner in the same process would inherit. So each runs here, in a child
started by :func:`run_offline` with the environment a test stack gets
(:func:`tests.e2e.server.stack_environment`), under the machine-wide vLLM lock for its whole
life, as the server fixtures do.

The child (``python -m tests.e2e.offline_harness CONFIG``) creates the ``LLM``, says it is
ready, then runs one call per line of its stdin, ``{"call", "args", "kwargs", "sampling"}``:
``offline.<call>(llm, *args, sampling_params, **kwargs)``; each result goes to a pickle file
(plain Python and numpy: no vLLM class crosses), and each reply, a JSON line, to a pipe of its
own (vLLM logs to stdout).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import selectors
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.server import STARTUP_TIMEOUT, TEST_VLLM_ARGS, stack_environment
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time, stop_process_group
from vllm_hidden_state_proxy.protocol import RING_DIR_ENV

#: The shared test stack's vLLM options, as ``LLM`` arguments (small batches chunk prefills).
LLM_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": int(TEST_VLLM_ARGS[TEST_VLLM_ARGS.index("--max-model-len") + 1]),
    "max_num_batched_tokens": int(
        TEST_VLLM_ARGS[TEST_VLLM_ARGS.index("--max-num-batched-tokens") + 1]
    ),
    "max_num_seqs": int(TEST_VLLM_ARGS[TEST_VLLM_ARGS.index("--max-num-seqs") + 1]),
    "enable_prefix_caching": True,
}
#: Seconds one call may take (20,000 prompts on V2's interpreted Triton among them).
CALL_TIMEOUT = 900.0


class OfflineCallError(Exception):
    """A call raised in the child: its exception's type name, message, and the offline error's
    ``status`` and ``index`` where it has them."""

    def __init__(self, kind: str, message: str, status: int | None, index: int | None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.status = status
        self.index = index


@dataclass
class OfflineLLM:
    """The child holding the ``LLM``: :meth:`call` runs one offline call there."""

    process: subprocess.Popen[bytes]
    replies: Any
    work_dir: Path
    log_path: Path
    ring_dir: Path
    runner: str
    calls: int = 0
    #: From starting the child to the ``LLM`` being ready (the lock's wait not counted).
    startup_seconds: float = 0.0

    def call(self, name: str, *args: Any, sampling: Any = None, **kwargs: Any) -> Any:
        """``offline.<name>(llm, *args, SamplingParams(**sampling), **kwargs)``'s result, as
        plain data: per prompt ``{"prompt_token_ids", "outputs": [{"index", "token_ids",
        "text"}], "entries": [{"vector", "by_layer", "info"}]}`` (``embed``: its array)."""
        self.calls += 1
        out = self.work_dir / f"call-{self.calls}.pickle"
        line = {"call": name, "args": args, "kwargs": kwargs, "sampling": sampling, "out": str(out)}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(line).encode() + b"\n")
        self.process.stdin.flush()
        reply = self._reply(CALL_TIMEOUT)
        if not reply["ok"]:
            raise OfflineCallError(
                reply["kind"], reply["message"], reply.get("status"), reply.get("index")
            )
        with open(out, "rb") as results:
            loaded = pickle.load(results)
        out.unlink()
        return loaded

    def _reply(self, timeout: float) -> dict[str, Any]:
        """The child's next reply line; a ``RuntimeError`` with its log's tail if it exits or
        says nothing in time."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.replies, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(timeout=1.0):
                    line = self.replies.readline()
                    if line:
                        reply: dict[str, Any] = json.loads(line)
                        return reply
                if self.process.poll() is not None:
                    break
        raise RuntimeError(f"the offline LLM's process said nothing; its log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_offline(
    model_dir: Path,
    work_dir: Path,
    runner: str,
    env_overrides: dict[str, str] | None = None,
    llm_options: dict[str, Any] | None = None,
    *,
    require_ready: bool = True,
) -> Iterator[OfflineLLM]:
    """An ``LLM`` of ``model_dir`` on ``runner`` in a child process, until the block ends, under
    the machine-wide vLLM lock; its rings in a directory of its own, removed at the end."""
    ring_dir = Path("/dev/shm") / f"hsp-offline-{os.getpid()}-{work_dir.name}"
    env = {**stack_environment(runner), RING_DIR_ENV: str(ring_dir), **(env_overrides or {})}
    config = {"model": str(model_dir), "options": {**LLM_OPTIONS, **(llm_options or {})}}
    log_path = work_dir / "offline-llm.log"
    read_end, write_end = os.pipe()
    with one_vllm_at_a_time():
        started = time.monotonic()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.offline_harness", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "HSP_OFFLINE_REPLY_FD": str(write_end)},
                pass_fds=(write_end,),
                cwd=Path(__file__).parents[2],
                start_new_session=True,
            )
        os.close(write_end)
        replies = os.fdopen(read_end, "rb")
        llm = OfflineLLM(process, replies, work_dir, log_path, ring_dir, runner)
        try:
            ready = llm._reply(STARTUP_TIMEOUT)
            if require_ready and not ready["ok"]:
                raise RuntimeError(f"the LLM did not start: {ready}\n{llm.log_tail()}")
            llm.startup_seconds = time.monotonic() - started
            yield llm
        finally:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()  # the child exits at the end of its input
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)
            stop_process_group(process, "offline LLM", grace=30)
            replies.close()
            shutil.rmtree(ring_dir, ignore_errors=True)


# -- the child ---------------------------------------------------------------------------------


def _plain(result: Any) -> Any:
    """A call's result as plain data (see :meth:`OfflineLLM.call`)."""
    if not isinstance(result, list):
        return result  # embed's array
    plain = []
    for output, states in result:
        plain.append(
            {
                "prompt_token_ids": list(output.prompt_token_ids),
                "num_cached_tokens": output.num_cached_tokens,
                "outputs": [
                    {"index": c.index, "token_ids": list(c.token_ids), "text": c.text}
                    for c in output.outputs
                ],
                "entries": [
                    {"vector": e.vector, "by_layer": dict(e.by_layer), "info": dict(e.info or {})}
                    for e in states.entries
                ],
            }
        )
    return plain


def _serve(config: dict[str, Any], replies: Any) -> None:
    from vllm import LLM, SamplingParams

    from vllm_hidden_state_proxy import offline

    def reply(document: dict[str, Any]) -> None:
        replies.write(json.dumps(document) + "\n")
        replies.flush()

    llm = LLM(config["model"], **config["options"])
    reply({"ok": True, "ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sampling = request["sampling"]
        if isinstance(sampling, list):
            params: Any = [SamplingParams(**each) for each in sampling]
        else:
            params = None if sampling is None else SamplingParams(**sampling)
        call = getattr(offline, request["call"])
        try:
            if request["call"] == "embed":
                result = call(llm, *request["args"], **request["kwargs"])
            else:
                result = call(llm, *request["args"], params, **request["kwargs"])
            with open(request["out"], "wb") as out:
                pickle.dump(_plain(result), out)
        except Exception as error:
            traceback.print_exc()
            reply(
                {
                    "ok": False,
                    "kind": type(error).__name__,
                    "message": str(getattr(error, "message", error)),
                    "status": getattr(error, "status", None),
                    "index": getattr(error, "index", None),
                }
            )
            continue
        reply({"ok": True})


def main() -> None:
    replies = os.fdopen(int(os.environ.pop("HSP_OFFLINE_REPLY_FD")), "w")
    try:
        _serve(json.loads(sys.argv[1]), replies)
    except Exception as error:
        traceback.print_exc()
        replies.write(
            json.dumps({"ok": False, "kind": type(error).__name__, "message": str(error)})
        )
        replies.write("\n")
        replies.flush()


if __name__ == "__main__":  # vLLM spawns its engine: this must not run again there
    main()
