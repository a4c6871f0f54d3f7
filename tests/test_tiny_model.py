"""A cached tiny model is rebuilt whenever the code that builds it changes (its revision is a
digest of that code and the libraries that write it), never on a number someone must bump."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_hidden_state_proxy.tiny_model import is_built, source_revision


def test_the_revision_follows_the_builders_source(tmp_path: Path) -> None:
    builder = tmp_path / "builder.py"
    builder.write_text("HIDDEN_SIZE = 128\n")
    first = source_revision(builder)
    assert source_revision(builder) == first
    builder.write_text("HIDDEN_SIZE = 256\n")
    assert source_revision(builder) != first
    assert source_revision() not in (first, source_revision(builder))


def test_a_build_of_another_revision_is_not_built(tmp_path: Path) -> None:
    (tmp_path / "marker.json").write_text(json.dumps({"revision": "old"}))
    assert is_built(tmp_path, "marker.json", "old")
    assert not is_built(tmp_path, "marker.json", source_revision())
