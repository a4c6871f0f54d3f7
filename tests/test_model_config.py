"""What serve reads of a model before vLLM loads it (model_config.py): its config.json in a
directory or the Hugging Face cache, its layer count, and the refusal of layers it lacks, in the
worker hook's words. tests/test_serve.py runs serve with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_hidden_state_proxy import model_config
from vllm_hidden_state_proxy.protocol import LAYERS_ENV


def a_model(path: Path, config: Any) -> Path:
    """A model directory holding only its ``config.json``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_model_config_path_reads_a_directory_or_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    model = a_model(tmp_path / "model", {"num_hidden_layers": 3})
    assert model_config.model_config_path(str(model), []) == model / "config.json"
    (tmp_path / "empty").mkdir()
    for nothing in (str(tmp_path / "empty"), str(tmp_path / "absent"), "not a hub name!"):
        assert model_config.model_config_path(nothing, []) is None
    # Options that make vLLM read another config, or change it: left to the hook.
    for flag in ("--hf-overrides", "--hf-config-path", "--config-format"):
        assert model_config.model_config_path(str(model), [flag, "x"]) is None
        assert model_config.model_config_path(str(model), [f"{flag}=x"]) is None
    # A hub name in the cache (as huggingface_hub lays it out), at main or at --revision.
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--name"
    for revision, layers in (("aaa", 28), ("bbb", 4)):
        a_model(repo / "snapshots" / revision, {"num_hidden_layers": layers})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa")
    assert model_config.model_config_path("org/name", []) == repo / "snapshots/aaa/config.json"
    assert model_config.model_config_path("org/name", ["--revision", "bbb"]) == (
        repo / "snapshots/bbb/config.json"
    )
    assert model_config.model_config_path("org/other", []) is None  # not downloaded: not looked for


@pytest.mark.parametrize(
    ("config", "count"),
    [
        ({"num_hidden_layers": 28}, 28),
        ({"num_hidden_layers": 40, "text_config": {"num_hidden_layers": 2}}, 2),  # multimodal
        ({"text_config": {"hidden_size": 8}, "num_hidden_layers": 5}, 5),
        ({"n_layer": 12}, None),
        ({"num_hidden_layers": True}, None),
        ([], None),
    ],
)
def test_num_hidden_layers(tmp_path: Path, config: Any, count: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_config.num_hidden_layers(tmp_path / "config.json") == count


def test_layers_problem_is_the_hooks_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_hidden_state_proxy.worker_hook.layers import LayerConfigError, parse_layers

    model = str(a_model(tmp_path / "model", {"num_hidden_layers": 2}))
    with pytest.raises(LayerConfigError) as hook:
        parse_layers("0,-4", 2)
    problem = model_config.layers_problem(model, [], (0, -4))
    assert problem is not None
    assert problem.startswith(f"vLLM cannot serve what it was started with: {hook.value} (")
    assert model_config.layers_problem(model, [], (0, 1, 2, -3)) is None
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    assert model_config.layers_problem(model, [], None) is None  # the final layer only
    monkeypatch.setenv(LAYERS_ENV, "5")  # what the hook reads without --hidden-state-layers
    assert "layer 5 is out of range" in (model_config.layers_problem(model, [], None) or "")
    # No config on this machine: the hook checks after the load.
    assert model_config.layers_problem("fake-model", [], (99,)) is None
