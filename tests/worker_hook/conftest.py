"""Shared fixtures for the worker hook tests (no vLLM server, no GPU)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker_hook.fakes import CAPTURED, HAS_V1, HIDDEN, MODEL, V1ShapedState
from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    RING_SLOTS_ENV,
)
from vllm_hidden_state_proxy.ring import RingReader, RingWriter
from vllm_hidden_state_proxy.worker_hook import ring_start, runners

HOOK_LOGGER = "vllm.hidden_state_hook"
#: The instance number of the ``writer`` fixture's ring.
INSTANCE = 0x1234_5678_9ABC_DEF0


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
    """A real ring of ``HIDDEN``-d vectors of the ``CAPTURED`` layers for ``MODEL``, closed
    after the test."""
    w = RingWriter.create(
        ring_dir,
        hidden_size=HIDDEN,
        model=MODEL,
        slot_count=16,
        instance=INSTANCE,
        engine=0,
        num_hidden_layers=CAPTURED.num_hidden_layers,
        layers=CAPTURED.layers,
    )
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


@pytest.fixture
def ring_env(ring_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hook's environment: rings of 8 slots in ``ring_dir``, default modes, final layer
    only. Returns ``ring_dir`` (not created: the hook makes it)."""
    monkeypatch.setenv(RING_DIR_ENV, str(ring_dir))
    monkeypatch.setenv(RING_SLOTS_ENV, "8")
    monkeypatch.delenv(RING_DIR_MODE_ENV, raising=False)
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)  # auto: only refusals are fatal
    return ring_dir


@pytest.fixture(autouse=True)
def _release_failure_notes() -> Iterator[None]:
    """Failure notes are held for the process's lifetime; release the ones a test left."""
    before = len(ring_start._NOTES)
    try:
        yield
    finally:
        for note in ring_start._NOTES[before:]:
            note.close()
        del ring_start._NOTES[before:]


#: The hook's own lookup of V1's ``ExecuteModelState`` (``v1_shaped_state`` replaces it).
REAL_V1_STATE_CLASS = runners._v1_state_class


@pytest.fixture(autouse=True)
def v1_shaped_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM has no V1 runner (0.34 on), the V1 view reads :class:`V1ShapedState`.

    Most tests drive the capture through ``FakeV1Runner`` and ``V1RunnerView``: the capture's
    selection, poolings, rows and publication, against this vLLM's own ``SchedulerOutput``.
    Without V1 the view would refuse every such runner ("no V1 model runner", as it must for a
    real one), and all of them would test that refusal only. Tests of vLLM's own V1 classes are
    skipped there instead (``fakes.needs_v1``).
    """
    if not HAS_V1:
        monkeypatch.setattr(runners, "_v1_state_class", lambda: V1ShapedState)
