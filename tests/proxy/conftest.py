from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy.fakes import LAYERED, create_writer
from vllm_hidden_state_proxy.ring import RingWriter


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ring_dir(tmp_path: Path) -> str:
    return str(tmp_path / "rings")


@pytest.fixture
def writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring in ``ring_dir`` capturing the final layer, as a plain server's hook makes."""
    with create_writer(ring_dir) as ring:
        yield ring


@pytest.fixture
def layered_writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring in ``ring_dir`` capturing layers 0, 2 and the final one (4)."""
    with create_writer(ring_dir, LAYERED) as ring:
        yield ring
