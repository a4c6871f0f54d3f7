from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.moto_s3 import S3, moto_s3
from tests.object_stores import store_environment
from vllm_hidden_state_proxy.extract import sender


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries at once (a test that looks at the waits sets its own)."""
    monkeypatch.setattr(sender, "BACKOFF_FIRST", 0.0)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3]:
    """moto's S3 server on a free port, for the session (tests/moto_s3.py)."""
    with moto_s3() as s3:
        yield s3


@pytest.fixture
def s3(s3_server: S3) -> Iterator[S3]:
    """The S3 server, the environment pointed at it for this test."""
    with store_environment(s3_server):
        yield s3_server
