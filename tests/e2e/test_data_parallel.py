"""Data parallel and several vLLM servers per ring directory (issue #12), on real vLLM.

Every engine core has its own ring, named for its vLLM instance and ``data_parallel_index``;
the proxy finds a request key in whichever live ring holds it. An engine whose hook cannot
start its ring is named, at once, by every flagged request that lands there, by ``/metrics``,
by ``/health`` and by one line in the proxy's log.

Runs in the second pytest session (``own_server``): each test starts its own vLLM (two, side
by side, in the shared-directory test: each on one of the two cores, holding the machine-wide
lock once for both).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import COUNTED, Reference, assert_matches
from tests.e2e.server import RUNNERS, SERVED_MODEL_NAME, RunningStack, require_runner, run_serve
from tests.e2e.stack_probe import proxy_gauge_in, served_per_engine
from vllm_hidden_state_proxy.check import CheckFailed, check
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time
from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV

pytestmark = pytest.mark.own_server

#: Data parallelism on two cores: one core per engine, a small KV cache each.
DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
DP2 = ["--data-parallel-size", "2"]
FLAG = {"return_last_hidden_state": True}


def client_for(stack: RunningStack) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(stack: RunningStack, reference: Reference, index: int) -> None:
    messages = [{"role": "user", "content": f"Chat {index}: " + "rivers and hills " * (index % 6)}]
    with client_for(stack) as client:  # closed: its pooled sockets are not left to the GC
        response = client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=messages,
            max_completion_tokens=2,
            extra_body={**NO_THINKING, "kv_transfer_params": FLAG},
        )
    vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert_matches(vector, reference.last_hidden_state(ids))


def _stream(stack: RunningStack, reference: Reference, index: int) -> None:
    messages = [{"role": "user", "content": f"Stream {index}: " + "a lighthouse " * (index % 5)}]
    with client_for(stack) as client:
        stream = client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=messages,
            max_completion_tokens=3,
            stream=True,
            extra_body={**NO_THINKING, "kv_transfer_params": FLAG},
        )
        vectors = [
            extra["kv_transfer_params"]["last_hidden_state"]
            for chunk in stream
            if "kv_transfer_params" in (extra := chunk.model_extra or {})
        ]
    assert len(vectors) == 1, "one vector, on the first chunk with a choice"
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert_matches(vectors[0], reference.last_hidden_state(ids))


def _completions(stack: RunningStack, reference: Reference, index: int) -> None:
    prompts = [f"Completion {index}.{i}: the old mill " + "by the weir " * i for i in range(4)]
    with client_for(stack) as client:
        response = client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=prompts,
            max_tokens=1,
            extra_body={"kv_transfer_params": FLAG},
        )
    vectors = response.model_dump()["kv_transfer_params"]["last_hidden_states"]
    assert len(vectors) == len(prompts)
    for prompt, vector in zip(prompts, vectors, strict=True):
        assert_matches(
            vector, reference.last_hidden_state(reference.tokenizer(prompt)["input_ids"])
        )


def every_request_gets_its_own_vector(stack: RunningStack, reference: Reference) -> int:
    """64 concurrent flagged client requests (40 chats, 20 streams, 4 completions lists of 4
    prompts): every one a 200 with its own prompt's vector. Returns how many were sent."""
    jobs = (
        [(_chat, i) for i in range(40)]
        + [(_stream, i) for i in range(20)]
        + [(_completions, i) for i in range(4)]
    )
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job, stack, reference, index) for job, index in jobs]
        for future in futures:
            future.result()  # raises the first failure, with its message
    return len(jobs)


def served_by_engine(stack: RunningStack) -> dict[str, float]:
    return served_per_engine(httpx.get(stack.proxy_url + "/metrics", timeout=60).text)


def proxy_gauge(stack: RunningStack, name: str) -> float:
    return proxy_gauge_in(httpx.get(stack.proxy_url + "/metrics", timeout=60).text, name)


def ring_names(ring_dir: Path) -> list[str]:
    return sorted(path.name for path in ring_dir.glob("ring-*"))


def check_dp2_stack(stack: RunningStack, reference: Reference, label: str) -> None:
    names = ring_names(stack.ring_dir)
    assert len(names) == 2, names
    instances = {name.split("-")[1] for name in names}
    assert len(instances) == 1, f"two engines of one vLLM share its instance: {names}"
    assert [name.rsplit("-", 1)[1] for name in names] == ["dp0.bin", "dp1.bin"], names
    assert proxy_gauge(stack, "live_rings") == 2
    sent = every_request_gets_its_own_vector(stack, reference)
    served = served_by_engine(stack)
    COUNTED.append(
        f"{label}: {sent} concurrent flagged client requests, all 200 with their own vectors; "
        f"vLLM requests per engine: {served}"
    )
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, f"both engines served: {served}"
    assert sum(served.values()) >= sent
    assert proxy_gauge(stack, "engines_without_ring") == 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_dp2_every_flagged_request_gets_its_own_vector(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference, runner: str
) -> None:
    with run_serve(tiny_model_dir, tmp_path, DP2, DP_ENV, runner=runner) as stack:
        require_runner(stack, runner)
        check_dp2_stack(stack, reference, f"DP=2 ({runner})")


def test_dp2_behind_two_api_servers(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    with run_serve(tiny_model_dir, tmp_path, [*DP2, "--api-server-count", "2"], DP_ENV) as stack:
        check_dp2_stack(stack, reference, "DP=2, --api-server-count 2")


def test_two_servers_sharing_one_ring_directory_each_find_their_own_vectors(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    shared = Path("/dev/shm") / f"hsp-shared-{tmp_path.name}"
    stacks: list[RunningStack] = []
    with one_vllm_at_a_time(), contextlib.ExitStack() as running:
        for core in ("0", "1"):
            env = {"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": "1"}
            work = tmp_path / f"server-{core}"
            work.mkdir()
            stacks.append(
                running.enter_context(
                    run_serve(tiny_model_dir, work, (), env, ring_dir=shared, locked=False)
                )
            )
        names = ring_names(shared)
        assert len(names) == 2 and len({name.split("-")[1] for name in names}) == 2, names
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [
                pool.submit(job, stacks[i % 2], reference, i)
                for i in range(32)
                for job in (_chat, _stream)
            ]
            for future in futures:
                future.result()
        for stack in stacks:
            assert proxy_gauge(stack, "live_rings") == 2
        COUNTED.append(
            f"two servers, one ring directory: {len(futures)} concurrent flagged client "
            "requests, half to each proxy, all 200 with their own vectors"
        )
    with contextlib.suppress(OSError):
        for path in shared.iterdir():
            path.unlink()
        shared.rmdir()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``path`` (root only: CI runs as root)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


#: The ring of one engine of the tiny model (1024 slots of 128 floats) is just over 4 MiB, with
#: an arena of 1 MiB (:data:`SMALL_ARENA`) just over 5.
ONE_RING_FITS = 7 * 1024 * 1024
SMALL_ARENA = {ARENA_MIB_ENV: "1"}


def test_an_engine_whose_hook_cannot_start_is_named_at_once(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    """DP=2 on a ring directory with room for one ring: one engine's hook fails (no space).

    The proxy says so: its live-rings gauge is 1 and its engines-without-ring gauge 1, one log
    line names the engine, /health is 503 naming it, and a flagged request routed to that
    engine fails with that cause at once (the vector timeout is 300 s), while the other engine's
    requests keep getting their vectors.
    """
    with (
        small_tmpfs(tmp_path / "rings", ONE_RING_FITS) as rings,
        run_serve(
            tiny_model_dir,
            tmp_path,
            [*DP2, "--vector-timeout", "300"],
            {**DP_ENV, **SMALL_ARENA},
            ring_dir=rings,
            require_ready=False,
        ) as stack,
    ):
        assert proxy_gauge(stack, "live_rings") == 1
        assert proxy_gauge(stack, "engines_without_ring") == 1
        health = httpx.get(stack.proxy_url + "/health", timeout=30)
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        # In words for whoever asks (no exception text, pid or path: those are in the log).
        assert re.fullmatch(
            r"vLLM is healthy, but engine [01] \(data-parallel index\) has no ring: its worker "
            r"hook could not start\.",
            message,
        ), message

        def one(index: int) -> httpx.Response:
            messages = [{"role": "user", "content": f"Which engine? {index}"}]
            body = {
                "model": SERVED_MODEL_NAME,
                "messages": messages,
                "max_completion_tokens": 1,
                "kv_transfer_params": FLAG,
                **NO_THINKING,
            }
            # Far less than the 300 s vector timeout: a failure must come at once.
            return httpx.post(stack.proxy_url + "/v1/chat/completions", json=body, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(one, range(32)))
        failed = [r for r in responses if r.status_code != 200]
        assert failed, "no request landed on the engine without a ring"
        for response in failed:
            assert response.status_code == 503, response.text
            assert "could not start" in response.json()["error"]["message"]
        served = [(i, r) for i, r in enumerate(responses) if r.status_code == 200]
        assert served, "no request landed on the engine with a ring"
        for index, response in served:
            messages = [{"role": "user", "content": f"Which engine? {index}"}]
            ids = reference.chat_token_ids(messages, enable_thinking=False)
            vector = response.json()["kv_transfer_params"]["last_hidden_state"]
            assert_matches(vector, reference.last_hidden_state(ids))
        COUNTED.append(
            f"DP=2, one engine without a ring: of {len(responses)} flagged requests "
            f"{len(served)} got their vectors, {len(failed)} a 503 naming the engine at once"
        )
        log = stack.log_path.read_text(errors="replace")
        assert len(re.findall(r"no ring for engine [01] ", log)) == 1, "one log line"
        # `hidden-state-proxy check` stops at /health with the engine and the cause.
        with (
            httpx.Client(base_url=stack.proxy_url, timeout=120) as client,
            pytest.raises(CheckFailed) as refused,
        ):
            check(client, None, lambda line: None)
        # (In words: /health without the API key names the engine, not the exception.)
    assert re.match(
        r"/health is 503: .*engine [01] \(data-parallel index\) has no ring", str(refused.value)
    ), str(refused.value)
