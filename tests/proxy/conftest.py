from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import HIDDEN_SIZE


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ring_dir(tmp_path: Path) -> str:
    return str(tmp_path / "rings")


@pytest.fixture
def writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring in ``ring_dir``, as the worker hook would create it."""
    ring = RingWriter.create(
        ring_dir, writer_id="dp0", hidden_size=HIDDEN_SIZE, model="m", slot_count=16
    )
    try:
        yield ring
    finally:
        ring.close()
