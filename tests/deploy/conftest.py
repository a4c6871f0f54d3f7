"""Shared fixtures of the offline deployment tests (no Docker, no cluster, no network)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.commands import chart_manifests
from tests.deploy.deploy_helpers import VALUES_FILES


@pytest.fixture(scope="session")
def rendered() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """values-set name -> template path -> rendered objects (default values and each ci/ file)."""
    return {
        name: chart_manifests(path, release="rel", namespace="ns")
        for name, path in VALUES_FILES.items()
    }
