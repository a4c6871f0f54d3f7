"""Faults with real processes: vLLM killed mid-flight and restarted, the proxy restarted, the
ring wrapping around under load, ``serve`` exiting when its vLLM dies (issue #7).

Own servers (``own_server``): vLLM is started here directly, with the proxy as a separate
process in front of it, so each can be killed and restarted on its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import (
    SERVED_MODEL_NAME,
    STARTUP_TIMEOUT,
    TEST_VLLM_ARGS,
    proxy_process,
    run_serve,
    stack_environment,
    wait_healthy,
)
from tests.e2e.stack_probe import (
    metric,
    port_of,
    process_tree,
    queue_bytes,
    ring_publishes,
    stopped,
    vllm_processes,
    wait_until,
)
from vllm_hidden_state_proxy.processes import (
    NotHealthy,
    free_port,
    one_vllm_at_a_time,
    stop_process_group,
    vllm_command,
    wait_until_healthy,
)
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.serve import vllm_environment

pytestmark = pytest.mark.own_server

CHAT = "/v1/chat/completions"
VLLM_KEY = "vllm-own-key"
#: How long a fault may take to reach the client (it must not hang).
PROMPT_FAULT_SECONDS = 30


def kill_engine(vllm: list[psutil.Process]) -> int:
    """SIGKILL the engine-core process among ``vllm`` (a vLLM API server and everything below
    it; the model lives in the engine and its workers). Python's resource tracker in vLLM's
    process group unlinks the engine's shared memory once vLLM has stopped."""
    for process in vllm[1:]:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline()):
                process.kill()
                return int(process.pid)
    raise AssertionError(f"no EngineCore process under vLLM pid {vllm[0].pid}")


@contextlib.contextmanager
def vllm_process(
    model_dir: Path,
    ring_dir: Path,
    port: int,
    log: Path,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """vLLM until the block ends (a vLLM that does not stop within its grace is killed)."""
    # vLLM's key travels as serve gives it: in VLLM_API_KEY, out of the command line.
    keyed = vllm_environment(str(ring_dir), VLLM_KEY)
    environment = {**stack_environment(), **keyed, **(env or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            vllm_command(str(model_dir), port, TEST_VLLM_ARGS),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        stop_process_group(process, "vLLM", grace=30)


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_completion_tokens": 1,
        "kv_transfer_params": {"return_last_hidden_state": True},
        **extra,
    }


def check_vector(reference: Reference, response: httpx.Response, text: str) -> None:
    assert response.status_code == 200, response.text
    vector = response.json()["kv_transfer_params"]["last_hidden_state"]
    messages = [{"role": "user", "content": text}]
    assert_matches(vector, reference.last_hidden_state(reference.chat_token_ids(messages)))


def ring_epoch(ring_dir: Path) -> int:
    """The epoch of the one live ring in ``ring_dir`` (a restarted vLLM's engine writes a new
    file; the dead one's is swept)."""
    epochs = []
    for path in ring_dir.glob("ring-*.bin"):
        with RingReader.open(path) as reader:
            if reader.is_live():
                epochs.append(reader.epoch)
    assert len(epochs) == 1, f"expected one live ring in {ring_dir}: {epochs}"
    return epochs[0]


def wait_status(url: str, status: int, timeout: float) -> float:
    """Seconds until GET ``url`` answers ``status``."""
    start = time.monotonic()
    try:
        # A probe outlasts the proxy's own 2 s wait for vLLM's /health.
        wait_until_healthy(url, None, timeout, status=status, interval=0.2, probe_timeout=5)
    except NotHealthy:
        raise AssertionError(f"{url} did not answer {status} within {timeout} s") from None
    return time.monotonic() - start


#: Choices of each long request of the kill test (vLLM runs each as a request of its own).
IN_FLIGHT_CHOICES = 32


def vllm_requests(vllm_url: str) -> float:
    """Requests running or waiting in vLLM (its /metrics, open even with --api-key)."""
    text = httpx.get(vllm_url + "/metrics", timeout=60).text
    return metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")


def in_flight(url: str, kind: str) -> tuple[str, int | str, float]:
    """A long request; returns (kind, status or how the stream ended, when it ended)."""
    # 32 choices with logprobs make 900 tokens last several seconds on the tiny model (alone,
    # 900 tokens can take well under a second), so the kill surely lands mid-generation.
    body = chat_body(
        f"in flight {kind}",
        max_completion_tokens=900,
        ignore_eos=True,
        n=IN_FLIGHT_CHOICES,
        logprobs=True,
        top_logprobs=5,
    )
    if kind == "ordinary":
        body.pop("kv_transfer_params")
    if kind == "stream":
        body["stream"] = True
        try:
            with httpx.stream("POST", url + CHAT, json=body, timeout=120) as response:
                tail = b""
                with contextlib.suppress(httpx.HTTPError):
                    for chunk in response.iter_raw():
                        tail = (tail + chunk)[-400:]
            ended = "error-event" if b'"error"' in tail else "cut"
            return (
                kind,
                ended if response.status_code == 200 else response.status_code,
                (time.monotonic()),
            )
        except httpx.HTTPError:
            return kind, "cut", time.monotonic()
    try:
        response = httpx.post(url + CHAT, json=body, timeout=120)
        return kind, response.status_code, time.monotonic()
    except httpx.HTTPError:
        return kind, "connection-error", time.monotonic()


def wrapped_request(
    url: str,
    vllm_url: str,
    vllm: subprocess.Popen[bytes],
    proxy: subprocess.Popen[bytes],
    ring_dir: Path,
) -> None:
    """A flagged request whose record is overwritten before the proxy reads it, by states:
    vLLM stands still until the request has reached its socket; then the proxy stands still
    while vLLM publishes its record and two more (sent to vLLM directly, with request keys of
    their own) into the one slot. The proxy, let go, answers 504 "overwritten"."""
    vllm_pids = [process.pid for process in process_tree(vllm.pid)]
    proxy_pids = [process.pid for process in process_tree(proxy.pid)]
    # Long enough that the request's headers alone cannot fill vLLM's receive queue to it.
    body = chat_body("wrapped " + "word " * 100)
    before = ring_publishes(ring_dir)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as frozen:
        with stopped(vllm_pids):
            answer = pool.submit(httpx.post, url + CHAT, json=body, timeout=120)
            size, port = len(json.dumps(body)), port_of(vllm_url)
            sent = wait_until(lambda: queue_bytes(port, received=True) >= size, 60)
            assert sent is not None, "the proxy never sent the request to vLLM"
            frozen.enter_context(stopped(proxy_pids))  # before vLLM runs again
        headers = {"authorization": f"Bearer {VLLM_KEY}"}
        for index in range(2):
            direct = {
                **chat_body(f"direct {index}"),
                "vllm_xargs": {REQUEST_KEY_ENTRY: secrets.token_hex(16)},
            }
            del direct["kv_transfer_params"]
            reply = httpx.post(vllm_url + CHAT, json=direct, headers=headers, timeout=60)
            assert reply.status_code == 200, reply.text
        published = wait_until(lambda: ring_publishes(ring_dir) >= before + 3, 60)
        assert published is not None, (
            f"vLLM published {ring_publishes(ring_dir) - before} records, not 3"
        )
        frozen.close()  # the proxy runs again and looks its record up
        response = answer.result(timeout=120)
    assert response.status_code == 504, response.text
    assert "overwritten" in response.json()["error"]["message"]


def test_vllm_killed_restarted_proxy_restarted_and_a_ring_that_wraps(
    tiny_model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    ring_dir = Path("/dev/shm") / f"hsp-faults-{os.getpid()}"
    vllm_port, proxy_port = free_port(), free_port()
    vllm_url = f"http://127.0.0.1:{vllm_port}"
    proxy_log, vllm_log = tmp_path / "proxy.log", tmp_path / "vllm.log"
    upstream_key = {"HIDDEN_STATE_PROXY_UPSTREAM_API_KEY": VLLM_KEY}
    try:
        with (
            one_vllm_at_a_time(),
            proxy_process(vllm_url, ring_dir, proxy_log, (), upstream_key, proxy_port) as (
                url,
                proxy,
            ),
        ):
            with vllm_process(tiny_model_dir, ring_dir, vllm_port, vllm_log) as vllm:
                wait_healthy(url + "/health", vllm, STARTUP_TIMEOUT, vllm_log)
                check_vector(
                    reference,
                    httpx.post(url + CHAT, json=chat_body("before"), timeout=60),
                    "before",
                )
                first_epoch = ring_epoch(ring_dir)

                # vLLM's own --api-key works through a proxy that has none of its own.
                with proxy_process(vllm_url, ring_dir, tmp_path / "plain.log") as (plain, p2):
                    wait_healthy(plain + "/health", p2, 30, tmp_path / "plain.log")
                    headers = {"authorization": f"Bearer {VLLM_KEY}"}
                    ok = httpx.post(
                        plain + CHAT, json=chat_body("key"), headers=headers, timeout=60
                    )
                    check_vector(reference, ok, "key")
                    denied = httpx.post(plain + CHAT, json=chat_body("key"), timeout=60)
                    assert denied.status_code == 401  # vLLM's own answer, passed through

                # Kill the engine while long requests are in flight.
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    kinds = ["flagged", "ordinary", "stream", "flagged"]
                    futures = [pool.submit(in_flight, url, kind) for kind in kinds]
                    # Every choice of all four requests is in vLLM (each is n=32 requests in
                    # its engine), so the kill surely lands mid-generation for all of them.
                    everything = IN_FLIGHT_CHOICES * len(kinds)
                    arrived = wait_until(lambda: vllm_requests(vllm_url) >= everything, 120)
                    assert arrived is not None, f"{vllm_requests(vllm_url):g} of {everything}"
                    killed_at = time.monotonic()
                    kill_engine(process_tree(vllm.pid))
                    outcomes = [f.result(timeout=PROMPT_FAULT_SECONDS + 60) for f in futures]
                for kind, status, ended in outcomes:
                    assert ended - killed_at < PROMPT_FAULT_SECONDS, (kind, status)
                    assert status not in (200, 504), (kind, status)  # a failure, not a hang
                    if isinstance(status, int):
                        assert status >= 500, (kind, status)
                assert (
                    wait_status(url + "/health", 503, PROMPT_FAULT_SECONDS) < PROMPT_FAULT_SECONDS
                )
                after_kill = httpx.post(url + CHAT, json=chat_body("dead"), timeout=60)
                assert after_kill.status_code in (500, 502, 503), after_kill.text

            # vLLM restarts (compose / Kubernetes would do this) with a one-slot ring.
            with vllm_process(
                tiny_model_dir,
                ring_dir,
                vllm_port,
                vllm_log,
                {"HIDDEN_STATE_PROXY_RING_SLOTS": "1"},
            ) as vllm:
                wait_healthy(url + "/health", vllm, STARTUP_TIMEOUT, vllm_log)
                assert proxy.poll() is None, "the proxy survives vLLM's death"
                check_vector(
                    reference, httpx.post(url + CHAT, json=chat_body("after"), timeout=60), "after"
                )
                assert ring_epoch(ring_dir) != first_epoch

                # Wrap-around: one slot, many concurrent flagged prompts.
                texts = [f"wrap {i} " + "word " * (i % 7) for i in range(24)]

                def ask(index: int) -> httpx.Response:
                    extra = {"max_completion_tokens": 1 + 40 * (index % 3), "ignore_eos": True}
                    return httpx.post(
                        url + CHAT, json=chat_body(texts[index], **extra), timeout=120
                    )

                with concurrent.futures.ThreadPoolExecutor(24) as pool:
                    responses = list(pool.map(ask, range(24)))
                overwritten = 0
                for text, response in zip(texts, responses, strict=True):
                    if response.status_code == 504:
                        assert "overwritten" in response.json()["error"]["message"]
                        overwritten += 1
                    else:
                        check_vector(reference, response, text)  # its own vector, never another's
                # Whether those wrapped depends on how vLLM batched them; this one surely does.
                wrapped_request(url, vllm_url, vllm, proxy, ring_dir)
                overwritten += 1
                metrics = httpx.get(url + "/metrics", timeout=30).text
                misses = metric(metrics, "hidden_state_proxy_vector_misses_total", "overwritten")
                assert misses == overwritten, (misses, overwritten)
                assert 'hidden_state_proxy_vector_misses_total{reason="overwritten"}' in metrics

                # The proxy restarts while vLLM runs: the first request gets its vector.
                stop_process_group(proxy, "proxy", grace=10)
                with proxy_process(vllm_url, ring_dir, proxy_log, (), upstream_key, proxy_port) as (
                    url2,
                    proxy2,
                ):
                    wait_healthy(url2 + "/health", proxy2, 30, proxy_log)
                    first = httpx.post(url2 + CHAT, json=chat_body("fresh proxy"), timeout=60)
                    check_vector(reference, first, "fresh proxy")
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)


def test_serve_exits_non_zero_when_its_vllm_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    with run_serve(tiny_model_dir, tmp_path) as stack:
        kill_engine(vllm_processes(stack))
        status = stack.process.wait(timeout=120)
    assert status != 0
    log = stack.log_path.read_text(errors="replace")
    assert "exited" in log or "died" in log, log[-2000:]
