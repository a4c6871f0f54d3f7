"""Fixtures of the compose test: a Docker engine, the tiny model and the running compose stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose import docker_host
from tests.compose.pod import POD_EVENTS, POD_PHASES
from tests.compose.stack import PHASES, VERSIONS, ComposeStack, leftovers, run_compose_stack, timed
from tests.e2e.reference import Reference
from vllm_hidden_state_proxy.tiny_model import build_tiny_model


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if VERSIONS:
        terminalreporter.write_line(
            "compose stack ran on: " + ", ".join(f"{k} {v}" for k, v in VERSIONS.items())
        )
    for phase, seconds in PHASES:
        terminalreporter.write_line(f"compose stack: {phase}: {seconds:.0f} s")
    for phase, seconds in POD_PHASES:
        terminalreporter.write_line(f"helm pod: {phase}: {seconds:.0f} s")
    for event in POD_EVENTS:
        terminalreporter.write_line(f"helm pod event: {event}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("compose-model") / "tiny-chat-model")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def compose_stack(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeStack]:
    with timed("Docker engine and Compose (apt, the plugin, dockerd: when missing)"):
        reason = docker_host.ensure_engine()
    if reason is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("compose")
    with run_compose_stack(model_dir, work) as stack:
        yield stack
    left = leftovers(stack.project)
    assert not left, f"docker compose down -v left {left}"
