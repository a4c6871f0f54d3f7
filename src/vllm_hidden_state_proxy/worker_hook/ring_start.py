"""Starting an engine's capture: the layers asked of the model, the ring created, or the note
left in its place that says why there is none (the proxy names it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vllm_hidden_state_proxy.protocol import RING_DIR_ENV
from vllm_hidden_state_proxy.ring import (
    FailureNote,
    RingDirectoryConflict,
    RingWriter,
    check_shareable,
)
from vllm_hidden_state_proxy.ring.files import (
    PRIVATE_MODES,
    DirectoryLocked,
    UntrustedDirectory,
    create_directory,
    directory_locked,
)
from vllm_hidden_state_proxy.worker_hook.compat import (
    describe_vllm,
    is_tested_version,
    vllm_version,
)
from vllm_hidden_state_proxy.worker_hook.engine import EngineIdentity
from vllm_hidden_state_proxy.worker_hook.layers import (
    CapturedLayers,
    LayerConfigError,
    configured_layers,
    enable_aux_outputs,
)
from vllm_hidden_state_proxy.worker_hook.runners import (
    RefusedSettings,
    RunnerView,
    UnsupportedRunner,
)
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

logger = logging.getLogger("vllm.hidden_state_hook")

#: Where ``prepare_layers`` leaves its outcome on the runner: ``CapturedLayers`` or the error.
LAYERS_ATTR = "_hidden_state_proxy_layers"


def check_settings(vllm_config: Any) -> None:
    """Refuse servers whose steps do not give the hook a generative batch's hidden states."""
    size = int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)
    if size > 1:
        raise RefusedSettings(
            f"prefill_context_parallel_size={size}: prefill context parallelism splits each "
            "step's batch across ranks, which this hook does not support yet"
        )
    runner_type = getattr(vllm_config.model_config, "runner_type", "generate")
    if runner_type == "pooling":
        # V1 returns the pooler's output before keeping any step state, V2's pool() never
        # reaches the hook: no vector could ever be published.
        raise RefusedSettings(
            "vLLM runs this model as a pooling model (--runner pooling / --convert), whose "
            "steps keep no hidden states for the hook; serve it with --runner generate, or use "
            "vLLM's own /v1/embeddings of the pooling server"
        )


def prepare_layers(runner: Any) -> None:
    """Right after ``load_model``: ask the model for the configured intermediate layers.

    Never raises: the outcome (the layers, or the error) waits on the runner for the capture,
    which turns an error into this engine's failure note. Runs once per runner.
    """
    if LAYERS_ATTR in runner.__dict__:
        return
    try:
        captured = configured_layers(runner.vllm_config)
        enable_aux_outputs(runner, captured)
    except Exception as error:
        logger.error("vllm-hidden-state-proxy: cannot capture the configured layers: %s", error)
        runner.__dict__[LAYERS_ATTR] = error
        return
    if captured.aux_ids:
        logger.info(
            "vllm-hidden-state-proxy: the model returns layers %s as auxiliary outputs",
            ",".join(map(str, captured.aux_ids)),
        )
    runner.__dict__[LAYERS_ATTR] = captured


def layers_of(runner: Any) -> CapturedLayers:
    outcome = runner.__dict__.get(LAYERS_ATTR)
    if isinstance(outcome, Exception):
        raise outcome
    if isinstance(outcome, CapturedLayers):
        return outcome
    captured = configured_layers(runner.vllm_config)
    if captured.aux_ids:
        raise LayerConfigError(
            "the model was loaded before the worker hook could ask it for its intermediate "
            "layers (was the hook installed late?)"
        )
    return captured


#: Failure notes of this process's engines, held (live) for the process's lifetime.
_NOTES: list[FailureNote] = []


#: Errors that are the operator's settings (the note says ``refused_settings``).
_REFUSED = (LayerConfigError, RingDirectoryConflict, RefusedSettings, DirectoryLocked)


def note_message(error: BaseException, view: RunnerView) -> str:
    """The note's text: the error, then on which vLLM and which of its runners (what a
    reader needs to tell a vLLM the hook does not fit from a setting it refused)."""
    runner = getattr(view, "label", None) or f"{view.name.upper()} model runner"
    where = f"{describe_vllm()}, {runner}"
    return f"{type(error).__name__}: {error} [{where}]"


def leave_note(identity: EngineIdentity, error: BaseException, view: RunnerView) -> None:
    """Tell proxies that this engine has no ring, and why (best effort: never raises).

    Fatal (``/health`` 503 while no ring is live, ``serve`` exits) when the operator's
    settings were refused, when this vLLM lacks what the hook reads (it will not start working
    by itself), and for any failure when the hook is required (``HIDDEN_STATE_PROXY_HOOK=1``).
    """
    if isinstance(error, UntrustedDirectory):
        # A note there could be replaced or forged by whoever controls the directory, and
        # proxies refuse the directory for the same reason: this log line is the one place
        # that says why (the proxy names its own check's verdict).
        logger.error(
            "vllm-hidden-state-proxy: no ring for engine %d: %s (%s); no failure note is left "
            "there either",
            identity.engine,
            error,
            RING_DIR_ENV,
        )
        return
    settings = HookSettings()
    try:
        try:
            dir_mode, file_mode = settings.ring_modes
        except ValueError:  # a malformed mode: the note (private) says so, the ring could not
            dir_mode, file_mode = PRIVATE_MODES
        refused = isinstance(error, _REFUSED)
        _NOTES.append(
            FailureNote.write(
                settings.ring_dir,
                instance=identity.instance,
                engine=identity.engine,
                message=note_message(error, view),
                refused_settings=refused,
                fatal=refused or isinstance(error, UnsupportedRunner) or settings.hook_mode == "on",
                dir_mode=dir_mode,
                file_mode=file_mode,
            )
        )
    except Exception as note_error:
        logger.warning(
            "vllm-hidden-state-proxy: could not leave a failure note for proxies either: %s",
            note_error,
        )


def create_ring(
    runner: Any, view: RunnerView, identity: EngineIdentity, model_name: str
) -> tuple[RingWriter, CapturedLayers]:
    view.check(runner)  # raises UnsupportedRunner before any ring file exists
    vllm_config = runner.vllm_config
    check_settings(vllm_config)
    captured = layers_of(runner)
    settings = HookSettings()
    dir_mode, file_mode = settings.ring_modes
    slots = settings.ring_slots
    hidden_size = int(vllm_config.model_config.get_hidden_size())
    ring_dir = Path(settings.ring_dir)
    create_directory(ring_dir, dir_mode)  # raises UntrustedDirectory
    # Another server's hook may be adding its ring right now; the deadline because anyone who
    # can open the directory can hold its lock, and this runs inside vLLM's startup.
    with directory_locked(ring_dir, dir_mode=dir_mode, timeout=settings.ring_lock_timeout):
        check_shareable(
            ring_dir,
            instance=identity.instance,
            hidden_size=hidden_size,
            num_hidden_layers=captured.num_hidden_layers,
        )
        writer = RingWriter.create(
            ring_dir,
            instance=identity.instance,
            engine=identity.engine,
            hidden_size=hidden_size,
            num_hidden_layers=captured.num_hidden_layers,
            layers=captured.layers,
            model=model_name,
            slot_count=slots,
            arena_size=settings.arena_bytes,
            max_record=min(settings.max_record_bytes, settings.arena_bytes),
            dir_mode=dir_mode,
            file_mode=file_mode,
            runner=f"vLLM {vllm_version()} {view.name.upper()} {type(runner).__name__}",
        )
    version = vllm_version()
    if not is_tested_version(version):
        logger.warning(
            "vllm-hidden-state-proxy: vLLM %s is not a version this hook was tested with; its "
            "startup checks passed, so it runs (run `hidden-state-proxy check` against it)",
            version,
        )
    logger.info(
        "vllm-hidden-state-proxy: worker hook active (%s runner) on vLLM %s, engine %d of "
        "instance %016x, publishing %d-d vectors of layers %s to %s (%d slots)",
        view.name,
        version,
        identity.engine,
        identity.instance,
        hidden_size,
        ",".join(map(str, captured.layers)),
        writer.path,
        slots,
    )
    return writer, captured


def served_name(model_config: Any) -> str:
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model_config.model)
