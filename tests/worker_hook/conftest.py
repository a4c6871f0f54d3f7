"""Shared fixtures for the worker hook tests (no vLLM server, no GPU)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.ring import RingReader, RingWriter

HOOK_LOGGER = "vllm.hidden_state_hook"
HIDDEN = 4
MODEL = "test-model"


class HookLog:
    """The hook logger's records (other loggers' records, e.g. the ring's, are left out)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    @property
    def records(self) -> list[logging.LogRecord]:
        return [r for r in self._caplog.records if r.name == HOOK_LOGGER]

    def clear(self) -> None:
        self._caplog.clear()


@pytest.fixture
def hook_log(caplog: pytest.LogCaptureFixture) -> Iterator[HookLog]:
    """Capture the hook's log records exactly once.

    vLLM's logging config (applied lazily) may set ``propagate=False`` on the ``vllm`` logger,
    which would hide the hook's records from caplog's root handler; so the handler is attached
    to the hook's own logger and propagation is switched off while the test runs.
    """
    logger = logging.getLogger(HOOK_LOGGER)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(caplog.handler)
    try:
        yield HookLog(caplog)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


@pytest.fixture
def clean_meta_path() -> Iterator[None]:
    """Run with no hook finder on ``sys.meta_path`` and restore it exactly afterwards."""
    from vllm_hidden_state_proxy.worker_hook.plugin import _PatchOnImport

    saved = list(sys.meta_path)
    sys.meta_path[:] = [f for f in saved if not isinstance(f, _PatchOnImport)]
    try:
        yield
    finally:
        sys.meta_path[:] = saved


@pytest.fixture
def ring_dir(tmp_path: Path) -> Path:
    return tmp_path / "rings"


@pytest.fixture
def writer(ring_dir: Path) -> Iterator[RingWriter]:
    """A real ring of ``HIDDEN``-d vectors for ``MODEL``, closed after the test."""
    w = RingWriter.create(ring_dir, writer_id="dp0", hidden_size=HIDDEN, model=MODEL, slot_count=16)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def reader(writer: RingWriter) -> Iterator[RingReader]:
    r = RingReader.open(writer.path)
    try:
        yield r
    finally:
        r.close()
