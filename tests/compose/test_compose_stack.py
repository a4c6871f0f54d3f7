"""``docker compose --profile cpu up`` for real (issue #16): both images built from
``deploy/docker/``, the shipped ``compose.yaml`` serving the tiny model, and every vector checked
against Transformers through the published proxy port with the official OpenAI client.

Needs a Docker engine: the fixtures install Debian's ``docker.io`` and the Compose v2 plugin and
start ``dockerd`` when they are missing (root, as in CI), and skip with one line only when no
engine can be had. Starts its own vLLM (in a container), so it runs in the ``own_server`` session.
The tests run in file order on one stack; the last one crashes vLLM's engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.compose.checks import (
    FLAG,
    KILL_ENGINE,
    PROXY_GID,
    PROXY_UID,
    RING_DIR,
    RING_DIR_MODE,
    RING_FILE_MODE,
    RING_STAT,
    expected_vector,
)
from tests.compose.stack import (
    LAYERS,
    PHASES,
    PROXY_SERVICE,
    SERVED_MODEL_NAME,
    VLLM_SERVICE,
    ComposeStack,
)
from tests.e2e.reference import Reference, assert_matches
from vllm_hidden_state_proxy.processes import healthy

pytestmark = [pytest.mark.e2e, pytest.mark.own_server, pytest.mark.timeout(1800)]

RECOVERY_TIMEOUT = 600.0


def _client(stack: ComposeStack) -> OpenAI:
    return OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def _flagged_vector(stack: ComposeStack, text: str) -> list[float]:
    response = _client(stack).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=_messages(text),
        max_completion_tokens=2,
        extra_body=FLAG,
    )
    vector: list[float] = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
    return vector


def test_flagged_chat_matches_transformers(
    compose_stack: ComposeStack, reference: Reference
) -> None:
    text = "Summarize this text in one word: A yellow bicycle beside a stone wall."
    assert_matches(_flagged_vector(compose_stack, text), expected_vector(reference, text))


def test_layers_set_through_compose_match_transformers(
    compose_stack: ComposeStack, reference: Reference
) -> None:
    text = "A layer through compose."
    response = _client(compose_stack).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=_messages(text),
        max_completion_tokens=1,
        extra_body={
            **FLAG,
            "kv_transfer_params": {
                "return_last_hidden_state": True,
                "last_hidden_state_layers": [int(layer) for layer in LAYERS.split(",")],
            },
        },
    )
    by_layer = response.model_dump()["kv_transfer_params"]["last_hidden_states_by_layer"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    assert set(by_layer) == set(LAYERS.split(","))
    for label, vector in by_layer.items():
        assert_matches(vector, reference.layer_vector(ids, int(label), "last"))


def test_streamed_flagged_chat(compose_stack: ComposeStack, reference: Reference) -> None:
    text = "What is the capital of France?"
    stream = _client(compose_stack).chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=_messages(text),
        max_completion_tokens=4,
        stream=True,
        extra_body=FLAG,
    )
    with_choice = [chunk for chunk in stream if chunk.choices]
    assert with_choice
    extra = with_choice[0].model_extra or {}
    assert_matches(
        extra["kv_transfer_params"]["last_hidden_state"], expected_vector(reference, text)
    )
    later = [(c.model_extra or {}).get("kv_transfer_params") or {} for c in with_choice[1:]]
    assert not any("last_hidden_state" in params for params in later)  # one vector, at the start


def test_concurrent_flagged_requests_get_their_own_vectors(
    compose_stack: ComposeStack, reference: Reference
) -> None:
    texts = [f"Count to {n} in words, then name {n} colours." for n in range(1, 9)]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        vectors = list(pool.map(lambda text: _flagged_vector(compose_stack, text), texts))
    for text, vector in zip(texts, vectors, strict=True):
        assert_matches(vector, expected_vector(reference, text))


def test_metrics_answer(compose_stack: ComposeStack) -> None:
    response = httpx.get(compose_stack.proxy_url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert "vllm:" in response.text  # vLLM's own metrics, fetched over the compose network
    assert "hidden_state_proxy_flagged_requests_total" in response.text


def test_only_the_proxy_port_is_published(compose_stack: ComposeStack) -> None:
    vllm = compose_stack.inspect(VLLM_SERVICE)
    assert not vllm["HostConfig"]["PortBindings"]
    assert all(bound is None for bound in vllm["NetworkSettings"]["Ports"].values())
    proxy = compose_stack.inspect(PROXY_SERVICE)
    published = proxy["HostConfig"]["PortBindings"]
    assert list(published) == ["8000/tcp"]
    assert compose_stack.proxy_url.endswith(":" + published["8000/tcp"][0]["HostPort"])


def test_proxy_runs_as_10001(compose_stack: ComposeStack) -> None:
    """The proxy's main process, as the kernel sees it (not what `docker exec` would run as)."""
    pid = compose_stack.inspect(PROXY_SERVICE)["State"]["Pid"]
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    assert {int(x) for x in status["Uid"].split()} == {PROXY_UID}
    assert {int(x) for x in status["Gid"].split()} == {PROXY_GID}


def test_ring_files_have_the_documented_modes(compose_stack: ComposeStack) -> None:
    found: dict[str, list[Any]] = json.loads(compose_stack.python(VLLM_SERVICE, RING_STAT))
    assert found.pop(RING_DIR) == [RING_DIR_MODE, 0, PROXY_GID, True]
    assert found, "no ring-*.bin file in the ring volume"
    for path, described in found.items():
        assert described == [RING_FILE_MODE, 0, PROXY_GID, False], path


def _wait_for(
    condition: Callable[[], bool], timeout: float, what: str, stack: ComposeStack
) -> float:
    """Poll ``condition`` until it holds; the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not after {timeout:.0f} s; logs:\n{stack.logs()}")
        time.sleep(0.5)
    return time.monotonic() - start


def test_vllm_crash_turns_health_red_and_the_restart_policy_brings_vectors_back(
    compose_stack: ComposeStack, reference: Reference
) -> None:
    """A crash of vLLM's engine (SIGKILL, as the kernel's OOM killer would): the proxy's /health
    turns 503 at once; vLLM's API server exits, `restart: unless-stopped` starts the container
    again, and health and vectors come back with the proxy container untouched. (`docker kill` or
    `docker stop` is a manual stop, which `unless-stopped` does not undo.)"""
    health = compose_stack.proxy_url + "/health"
    assert healthy(health)
    proxy_restarts = compose_stack.inspect(PROXY_SERVICE)["RestartCount"]
    killed = compose_stack.python(VLLM_SERVICE, KILL_ENGINE).split()
    assert len(killed) == 1, f"expected one engine process, killed {killed}"
    red = _wait_for(lambda: not healthy(health), 120, "proxy /health non-200", compose_stack)
    restarted = _wait_for(
        lambda: compose_stack.inspect(VLLM_SERVICE)["RestartCount"] >= 1,
        RECOVERY_TIMEOUT,
        "vLLM container restarted",
        compose_stack,
    )
    green = _wait_for(
        lambda: healthy(health), RECOVERY_TIMEOUT, "proxy /health 200 again", compose_stack
    )
    PHASES.append(("engine killed -> proxy /health non-200", red))
    PHASES.append(("-> vLLM container restarted", restarted))
    PHASES.append(("-> proxy /health 200 again", green))
    text = "Is the sky blue?"
    assert_matches(_flagged_vector(compose_stack, text), expected_vector(reference, text))
    assert compose_stack.inspect(PROXY_SERVICE)["RestartCount"] == proxy_restarts
