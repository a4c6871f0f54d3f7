"""What ``serve`` reads of a model before vLLM loads it: its ``config.json``, where that is on
this machine (a directory, or a hub name already in the Hugging Face cache: nothing is
downloaded), and from it the layers the model has, so that ``--hidden-state-layers`` asking for
one it lacks is refused in seconds, with the sentence the worker hook would write once the model
had loaded (the hook still checks, for models whose config is not here).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from vllm_hidden_state_proxy.protocol import LAYERS_ENV
from vllm_hidden_state_proxy.worker_hook.layers import LayerConfigError, parse_layers

#: vLLM options that make it read another config than MODEL's ``config.json``, or change it:
#: with any of them the layers are left to the hook, which checks them after the load.
_OTHER_CONFIG = ("--hf-config-path", "--hf-overrides", "--config-format")


def _option_value(vllm_args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) among vLLM's options; the last wins."""
    value = None
    for position, arg in enumerate(vllm_args):
        if arg == flag and position + 1 < len(vllm_args):
            value = vllm_args[position + 1]
        elif arg.startswith(flag + "="):
            value = arg.removeprefix(flag + "=")
    return value


def model_config_path(model: str, vllm_args: Sequence[str]) -> Path | None:
    """``model``'s ``config.json`` as vLLM would read it, if it is on this machine: in the
    directory ``model``, or in the Hugging Face cache for a hub name (at ``--revision``); None
    otherwise (nothing is downloaded), or when vLLM is told to read another config."""
    if any(_option_value(vllm_args, flag) is not None for flag in _OTHER_CONFIG):
        return None
    local = Path(model)
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    if local.exists():  # a file (GGUF): its config is inside it
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(
            model, "config.json", revision=_option_value(vllm_args, "--revision")
        )
    except (ValueError, OSError):  # not a hub name (HFValidationError is a ValueError)
        return None
    return Path(found) if isinstance(found, str) else None


def num_hidden_layers(config_path: Path) -> int | None:
    """The decoder layer count a config gives, as vLLM reads it (a multimodal model's
    ``text_config`` first); None if it gives none."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    for source in (text_config, config):
        if isinstance(source, dict):
            count = source.get("num_hidden_layers")
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                return count
    return None


def layers_problem(
    model: str, vllm_args: Sequence[str], layers: Sequence[int] | None
) -> str | None:
    """The refusal the worker hook would write once the model had loaded, from the model's
    config instead: layers (``--hidden-state-layers``, else the hook's variable) that the model
    does not have. None when they fit, or when its config is not on this machine (then the hook
    checks them after the load, as before)."""
    text = ",".join(map(str, layers)) if layers is not None else os.environ.get(LAYERS_ENV)
    if not text:
        return None
    config_path = model_config_path(model, vllm_args)
    count = None if config_path is None else num_hidden_layers(config_path)
    if count is None:
        return None
    try:
        parse_layers(text, count)
    except LayerConfigError as problem:
        return (
            f"vLLM cannot serve what it was started with: {problem} (num_hidden_layers of "
            f"{config_path}, read before loading the model)"
        )
    return None
