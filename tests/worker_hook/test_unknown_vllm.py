"""A vLLM the hook was not tested with (issue #26): it runs if the runner has what it reads, and
otherwise the engine's failure note names the version and the missing piece, which the proxy
answers flagged requests and ``/health`` with, instead of its generic "no ring" text.

The hook here is the real one (plugin wrappers, capture, note) on a runner holding vLLM's own
V1 state classes; the proxy is the real app on the same ring directory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
import vllm

from tests.proxy.fakes import FakeVLLM, error_of, proxy_client, settings_for
from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import HAS_V1, FakeV1Runner
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV
from vllm_hidden_state_proxy.ring import RingDirectory
from vllm_hidden_state_proxy.worker_hook import plugin, runners
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView

FLAGGED = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "kv_transfer_params": {"return_last_hidden_state": True},
}
UNKNOWN = "0.99.0"


class RenamedState(NamedTuple):
    """V1's ``ExecuteModelState`` as a later vLLM might have it: ``hidden_states`` renamed."""

    final_hidden_states: Any
    aux_hidden_states: Any


class Runner(FakeV1Runner):
    """Every method the hook wraps, declared (each :func:`runner_class` defines its own)."""

    def load_model(self) -> None: ...

    def initialize_kv_cache(self, config: Any) -> None: ...

    def execute_model(self, scheduler_output: Any) -> None: ...

    def sample_tokens(self, grammar_output: Any) -> str:
        return ""


def rename_hidden_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """V1's ``ExecuteModelState`` becomes :class:`RenamedState` (where vLLM has no V1: the
    stand-in that conftest's ``v1_shaped_state`` gives the hook does)."""
    if HAS_V1:
        import vllm.v1.worker.gpu_model_runner as v1_module

        monkeypatch.setattr(v1_module, "ExecuteModelState", RenamedState)
    else:
        monkeypatch.setattr(runners, "_v1_state_class", lambda: RenamedState)


def runner_class() -> type[Runner]:
    """A fresh runner class defining every method the hook wraps, patched as vLLM's would be."""

    class Fresh(Runner):
        def __init__(self) -> None:
            super().__init__()

        def load_model(self) -> None:
            return None

        def initialize_kv_cache(self, config: Any) -> None:
            return None

        def execute_model(self, scheduler_output: Any) -> None:
            return None

        def sample_tokens(self, grammar_output: Any) -> str:
            return "sampled"

    plugin.patch_runner_class(Fresh, V1RunnerView())
    return Fresh


@pytest.fixture
def unknown_vllm(monkeypatch: pytest.MonkeyPatch, ring_env: Path) -> Iterator[Path]:
    monkeypatch.setattr(vllm, "__version__", UNKNOWN)
    monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)
    yield ring_env


def chat_handler() -> Any:
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"id": "c", "object": "chat.completion", "choices": []})

    return handle


def test_an_unknown_version_whose_runner_fits_runs_and_says_once_that_it_is_untested(
    unknown_vllm: Path, hook_log: HookLog
) -> None:
    runner = runner_class()()
    runner.load_model()
    runner.initialize_kv_cache("cfg")
    capture = runner.__dict__[plugin._CAPTURE_ATTR]
    try:
        assert capture is not None and capture.writer is not None
        with RingDirectory(unknown_vllm) as directory:
            assert directory.live_ring_count() == 1
            assert directory.failed_engines() == ()
        warnings = [r for r in hook_log.records if r.levelno == logging.WARNING]
        [warning] = warnings
        assert f"vLLM {UNKNOWN} is not a version this hook was tested with" in (
            warning.getMessage()
        )
        assert "startup checks passed" in warning.getMessage()
    finally:
        capture.writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_unknown_version_with_a_renamed_internal_is_named_by_the_proxy(
    unknown_vllm: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    settings = settings_for(str(unknown_vllm), vector_timeout=30.0, api_key="k")
    key = {"authorization": "Bearer k"}
    # Before the hook ran at all, the proxy can only guess (the plugin is not installed?).
    async with proxy_client(settings, FakeVLLM(chat_handler())) as proxy:
        generic = error_of(
            await proxy.client.post("/v1/chat/completions", json=FLAGGED, headers=key)
        )
        assert "worker hook is not active" in generic["message"]

    rename_hidden_states(monkeypatch)
    runner = runner_class()()  # the check runs in __init__, before any step
    assert runner.__dict__[plugin._CAPTURE_ATTR] is None
    assert not list(unknown_vllm.glob("*.bin"))

    async with proxy_client(settings, FakeVLLM(chat_handler())) as proxy:
        flagged = await proxy.client.post("/v1/chat/completions", json=FLAGGED, headers=key)
        health = await proxy.client.get("/health", headers=key)
        words = await proxy.client.get("/health")  # without the key: in words only
        ordinary = await proxy.client.post(
            "/v1/chat/completions", json={"model": "m", "messages": []}, headers=key
        )
    assert flagged.status_code == 503
    message = error_of(flagged)["message"]
    for part in (
        f"vLLM {UNKNOWN} (untested by this hook)",
        "ExecuteModelState (V1) has no field hidden_states",
        "V1 model runner",
        "engine 0",
    ):
        assert part in message, message
    assert "worker hook is not active" not in message
    assert health.status_code == 503
    health_message = error_of(health)["message"]
    assert health_message.startswith("vLLM at http://vllm.test:8000 is healthy, but engine 0")
    assert "ExecuteModelState (V1) has no field hidden_states" in health_message
    assert f"vLLM {UNKNOWN}" in health_message
    assert words.status_code == 503
    assert error_of(words)["message"] == (
        "vLLM is healthy, but engine 0 (data-parallel index) has no ring: its worker hook "
        "cannot run there until vLLM is restarted or changed."
    )
    assert ordinary.status_code == 200  # ordinary traffic is untouched


def test_the_same_runner_on_a_tested_version_is_named_without_untested(
    ring_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    rename_hidden_states(monkeypatch)
    runner_class()()
    with RingDirectory(ring_env) as directory:
        [failure] = directory.failed_engines()
    assert "[vLLM 0.32.0, V1 model runner]" in failure.message
    assert failure.fatal and not failure.refused_settings
