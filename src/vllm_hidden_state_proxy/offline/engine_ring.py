"""The ring of an ``LLM``'s engine, found as a proxy finds its vLLM's: by the engine's identity
(the instance of its ``vllm_config``, its data-parallel index), in the hook's ring directory
(``HIDDEN_STATE_PROXY_RING_DIR``, read from this process's environment, which the ``LLM``'s
engine inherited). No live ring is the server's 503: the hook off, not installed, or its
failure note. Also: whether this vLLM has what the offline API drives it with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_hidden_state_proxy.offline.types import OfflineHiddenStateError
from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    PLUGIN_NAME,
    RING_DIR_ENV,
    VLLM_PLUGINS_ENV,
)
from vllm_hidden_state_proxy.ring import RingFormatError, RingReader
from vllm_hidden_state_proxy.ring.files import (
    UntrustedDirectory,
    check_directory,
    note_name,
    ring_name,
    self_and_root,
)
from vllm_hidden_state_proxy.ring.notes import read_live_note
from vllm_hidden_state_proxy.worker_hook.engine import engine_identity
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

#: What the offline API drives vLLM with, beyond ``LLM``'s public methods (checked on vLLM 0.32
#: and 0.34 by tests/worker_hook/test_offline_vllm.py): ``LLM.generate`` and ``LLM.chat`` render
#: their prompts with the first two, and ``LLMEngine``'s are vLLM's documented engine loop.
LLM_METHODS = ("_preprocess_cmpl_one", "_preprocess_chat_one", "get_default_sampling_params")
ENGINE_METHODS = ("add_request", "step", "has_unfinished_requests", "abort_request")


def check_vllm(llm: Any) -> None:
    """``OfflineHiddenStateError`` naming what this vLLM lacks of what the calls drive."""
    engine = getattr(llm, "llm_engine", None)
    missing = [f"LLM.{name}" for name in LLM_METHODS if not callable(getattr(llm, name, None))]
    missing += [
        f"LLMEngine.{name}" for name in ENGINE_METHODS if not callable(getattr(engine, name, None))
    ]
    if missing:
        from vllm import __version__

        raise OfflineHiddenStateError(
            f"vLLM {__version__} lacks {', '.join(missing)}, which the offline hidden states "
            "need (tested: vLLM 0.32 and 0.34): serve the model instead (hidden-state-proxy "
            "serve), or use a tested vLLM.",
            503,
        )


def engine_ring(llm: Any) -> RingReader:
    """The ring of ``llm``'s engine (its hook's); the server's 503, in its words, if there is
    none: the hook is off, not installed, or could not start (its failure note says why)."""
    vllm_config = llm.llm_engine.vllm_config
    identity = engine_identity(vllm_config)
    settings = HookSettings()
    directory = Path(settings.ring_dir)
    try:
        check_directory(directory, owner_uids=self_and_root(), dir_mode=None)
    except FileNotFoundError:
        pass  # no hook made it: said below
    except UntrustedDirectory as refused:
        raise OfflineHiddenStateError(
            f"The hidden state cannot be read: {refused}. Nothing is read there until that is "
            "fixed (vLLM's worker hook refuses the directory too).",
            503,
        ) from None
    try:
        path = directory / ring_name(identity.instance, identity.engine)
        reader = RingReader.open(path, owner_uids=self_and_root())
    except RingFormatError:
        reader = None
    if reader is not None and reader.is_live():
        return reader
    if reader is not None:
        reader.close()
    note_path = directory / note_name(identity.instance, identity.engine)
    note = read_live_note(note_path, self_and_root())
    if note is not None:
        raise OfflineHiddenStateError(
            f"The hidden state cannot be published: this LLM's engine has no ring. "
            f"{note.describe()}. Fix the cause and create the LLM again (vLLM's log has "
            "details).",
            503,
        )
    hook_off = settings.hook_mode == "off"
    raise OfflineHiddenStateError(
        "The hidden-state worker hook is not active in this LLM's engine"
        + (f" ({HOOK_ENABLED_ENV}=0 switches it off)" if hook_off else "")
        + ": install vllm-hidden-state-proxy into vLLM's Python environment (it registers a "
        f"`vllm.general_plugins` entry point), make sure {VLLM_PLUGINS_ENV} (if set) includes "
        f"`{PLUGIN_NAME}`, and create the LLM with {RING_DIR_ENV} as it is now "
        f"({directory}).",
        503,
    )
