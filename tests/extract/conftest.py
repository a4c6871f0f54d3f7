from __future__ import annotations

import pytest

from vllm_hidden_state_proxy.extract import sender


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries at once (a test that looks at the waits sets its own)."""
    monkeypatch.setattr(sender, "BACKOFF_FIRST", 0.0)
