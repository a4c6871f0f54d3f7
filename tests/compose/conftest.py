"""Fixtures of the compose test: a Docker engine, the tiny model and the running compose stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose import docker_host
from tests.compose.pod import POD_EVENTS, POD_PHASES
from tests.compose.stack import PHASES, VERSIONS, ComposeStack, leftovers, run_compose_stack, timed
from tests.model_fixtures import model_fixtures

tiny_model_dir, reference = model_fixtures("module")


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
def compose_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeStack]:
    with timed("Docker engine and Compose (apt, the plugin, dockerd: when missing)"):
        reason = docker_host.ensure_engine()
    if reason is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("compose")
    with run_compose_stack(tiny_model_dir, work) as stack:
        yield stack
    left = leftovers(stack.project)
    assert not left, f"docker compose down -v left {left}"
