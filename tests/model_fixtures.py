"""The tiny model and Transformers' reading of it as fixtures, for the suites that serve it:
e2e (one for the session, as its shared server) and compose (one per module, as each module's
stack mounts its own). Each suite's conftest takes them with its scope, and nothing else of the
other suite (no e2e server starts for compose)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.reference import Reference
from vllm_hidden_state_proxy.tiny_model import build_tiny_model


def model_fixtures(scope: pytest.ScopeName) -> tuple[object, object]:
    """The fixtures ``tiny_model_dir`` and ``reference``, of ``scope``: assign them to those
    names in a conftest."""

    @pytest.fixture(scope=scope)
    def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-chat-model")

    @pytest.fixture(scope=scope)
    def reference(tiny_model_dir: Path) -> Reference:
        return Reference(tiny_model_dir)

    return tiny_model_dir, reference
