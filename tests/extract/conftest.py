from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gcs_emulator import GCS, gcs_emulator
from tests.moto_s3 import S3, moto_s3
from tests.object_stores import Store, store_environment
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


@pytest.fixture(scope="session")
def gs_server() -> Iterator[GCS]:
    """gcp-storage-emulator's GCS on a free port, for the session (tests/gcs_emulator.py)."""
    with gcs_emulator() as gcs:
        yield gcs


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each object store's server in turn (named by its URIs' scheme), the environment pointed
    at it for this test."""
    server: Store = request.getfixturevalue(f"{request.param}_server")
    with store_environment(server):
        yield server
