"""The ``vllm.general_plugins`` entry point: attach the capture to vLLM's model runners.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers). The
hook must act only where a model runner exists, so it does not import the runner modules itself:
it installs an import hook that wraps the runner classes when (and only when) a process imports
them. It does so on any vLLM version: whether the hook can run is decided in the worker by the
runner's structure (:mod:`.compat`). Five methods are wrapped on each runner class (on the CPU
runner, which inherits the others, only its own ``load_model``):

- ``__init__``: checks that every method below is reached through its wrapper and that vLLM's
  classes have the fields the hook reads; if not, the engine's failure note names the vLLM
  version and the missing piece, and the hook stays out of this runner;

- ``load_model``: asks the model for the configured intermediate layers as auxiliary outputs,
  before warm-up, compilation and graph capture (see :mod:`.layers`);
- ``initialize_kv_cache``: creates the capture (and, on the publishing rank, the ring file) once
  the model is loaded, so the ring exists before the first request;
- ``execute_model``: after each step, starts copying the selected requests' vectors (on CPU,
  publishes them);
- ``sample_tokens``: makes sure those vectors are published before the step's output leaves the
  worker, without waiting for the device (see :mod:`.capture`).

One method is wrapped on the GPU worker (``vllm.v1.worker.gpu_worker.Worker``, whose
``load_model`` the CPU and XPU workers inherit): after it, a model runner of a class the hook did
not wrap (vLLM 0.34's non-x86 ``StandaloneCPUModelRunner``, a runner vLLM moved to another
module) gets the engine's failure note naming the vLLM version and the runner class, instead of
leaving the proxy to answer a generic 503.

It uses neither ``--kv-transfer-config`` nor ``--worker-extension-cls``, so users keep those for
LMCache/NIXL, and it does not depend on the API server, so vLLM's Rust frontend is fine.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.compat import NEEDED_METHODS, WRAPPED_ATTR
from vllm_hidden_state_proxy.worker_hook.engine import engine_identity, is_publishing_rank
from vllm_hidden_state_proxy.worker_hook.ring_start import leave_note, prepare_layers
from vllm_hidden_state_proxy.worker_hook.runners import (
    RefusedSettings,
    RunnerView,
    UnattachedRunnerView,
    UnsupportedRunner,
    V1RunnerView,
    V2RunnerView,
    structure_problems,
)
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

logger = logging.getLogger("vllm.hidden_state_hook")

#: The methods wrapped on a runner class that defines them itself.
ALL_METHODS = ("__init__", *NEEDED_METHODS)

#: module -> (runner class name, how to read it, methods to wrap)
RUNNER_MODULES: dict[str, tuple[str, RunnerView, tuple[str, ...]]] = {
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", V1RunnerView(), ALL_METHODS),
    "vllm.v1.worker.gpu.model_runner": ("GPUModelRunner", V2RunnerView(), ALL_METHODS),
    # A subclass of the V1 runner with its own load_model (it does not call the base one); its
    # __init__ calls the V1 one, whose wrapper checks the CPU runner class.
    "vllm.v1.worker.cpu_model_runner": ("CPUModelRunner", V1RunnerView(), ("load_model",)),
}

#: module -> worker class whose ``load_model`` is wrapped to check that the runner it built is
#: one the hook attached to (the GPU worker; the CPU and XPU workers inherit its ``load_model``).
WORKER_MODULES: dict[str, str] = {"vllm.v1.worker.gpu_worker": "Worker"}

_CAPTURE_ATTR = "_hidden_state_proxy_capture"
_WRAPPED_ATTR = WRAPPED_ATTR


def register() -> None:
    """Entry point. Never raises: a broken hook must not stop vLLM from starting."""
    try:
        if HookSettings().hook_mode == "off":
            logger.info("vllm-hidden-state-proxy: worker hook disabled by %s", HOOK_ENABLED_ENV)
            return
        install_runner_patches()
    except Exception:
        logger.exception("vllm-hidden-state-proxy: could not install the worker hook")


#: A runner class to wrap (class name, view, methods), or a worker class's name (a ``str``).
Target = tuple[str, RunnerView, tuple[str, ...]] | str


def install_runner_patches(modules: dict[str, Target] | None = None) -> None:
    """Patch runner (and worker) classes already imported, and the rest when they are imported."""
    targets: dict[str, Target] = (
        {**RUNNER_MODULES, **WORKER_MODULES} if modules is None else dict(modules)
    )
    for module_name, target in targets.items():
        module = sys.modules.get(module_name)
        if module is not None:
            _patch_module(module, target)
    waiting = {name: target for name, target in targets.items() if name not in sys.modules}
    if not waiting:
        return
    for finder in sys.meta_path:
        if isinstance(finder, _PatchOnImport):
            finder.targets.update(waiting)
            return
    sys.meta_path.insert(0, _PatchOnImport(waiting))


def _patch_module(module: ModuleType, target: Target) -> None:
    if isinstance(target, str):
        patch_worker_class(getattr(module, target))
    else:
        class_name, view, methods = target
        patch_runner_class(getattr(module, class_name), view, methods)


def patch_worker_class(cls: Any) -> None:
    """Wrap the worker's own ``load_model`` (idempotent): after it, a model runner the hook did
    not attach to gets a failure note (:func:`note_unattached_runner`)."""
    method = cls.__dict__.get("load_model")
    if method is None or getattr(method, _WRAPPED_ATTR, False):
        return
    wrapped = _then(method, note_unattached_runner)
    setattr(wrapped, _WRAPPED_ATTR, True)
    cls.load_model = wrapped


def is_attached(runner_cls: type) -> bool:
    """Whether the hook wrapped ``runner_cls``'s ``__init__`` (its own or a base's): then its
    structural checks ran when it was built, and their note says what is wrong, if anything."""
    return any(
        getattr(owner.__dict__.get("__init__"), _WRAPPED_ATTR, False)
        for owner in runner_cls.__mro__
    )


def note_unattached_runner(worker: Any) -> None:
    """If ``worker.model_runner`` is of a class the hook never wrapped (a runner vLLM moved to
    another module, or one the hook does not know, such as vLLM 0.34's non-x86
    ``StandaloneCPUModelRunner``), log it and leave the engine's failure note, naming the vLLM
    version and the runner class: else the proxy could only answer a generic 503. A runner
    that serves no generation (``--mm-encoder-only``) is left alone. Never raises."""
    try:
        runner = getattr(worker, "model_runner", None)
        if runner is None or is_attached(type(runner)):
            return
        vllm_config = worker.vllm_config
        if getattr(vllm_config, "is_mm_encoder_only", False):
            return
        view = UnattachedRunnerView(type(runner))
        known = ", ".join(f"{module}.{name}" for module, (name, *_) in RUNNER_MODULES.items())
        error = UnsupportedRunner(
            f"this vLLM built the model runner {view.name}, which the hook does not attach to "
            f"(it attaches to {known} and their subclasses)"
        )
        logger.warning(
            "vllm-hidden-state-proxy: worker hook not attached: %s. Flagged requests get 503 "
            "from the proxy; ordinary traffic is unaffected.",
            error,
        )
        if is_publishing_rank(vllm_config.parallel_config):
            leave_note(engine_identity(vllm_config), error, view)
    except Exception:
        logger.exception("vllm-hidden-state-proxy: unexpected error in the worker hook")


def patch_runner_class(cls: Any, view: RunnerView, methods: Sequence[str] = ALL_METHODS) -> None:
    """Wrap ``methods`` where ``cls`` defines them itself (idempotent per method).

    A method ``cls`` does not define is not wrapped here; the wrapped ``__init__`` (or, without
    one, the capture's start) finds it missing and leaves a failure note.
    """
    wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "__init__": lambda method: _wrap_init(method, view),
        "load_model": lambda method: _then(method, prepare_layers),
        "initialize_kv_cache": lambda method: _then(
            method, lambda runner: capture_for(runner, view)
        ),
        "execute_model": lambda method: _wrap_execute_model(method, view),
        "sample_tokens": _wrap_sample_tokens,
    }
    for name in methods:
        method = cls.__dict__.get(name)
        if method is None or getattr(method, _WRAPPED_ATTR, False):
            continue
        wrapped = wrappers[name](method)
        setattr(wrapped, _WRAPPED_ATTR, True)
        setattr(cls, name, wrapped)


def _refuse_if_misshapen(runner: Any, view: RunnerView) -> bool:
    """Whether ``runner``'s class fails the structural startup checks; if it does, the hook
    stays out of it (logged once, and the engine's failure note says why). Never raises."""
    try:
        problems = structure_problems(type(runner), view)
    except Exception as import_error:  # a vLLM class the checks import is gone
        problems = [f"{type(import_error).__name__}: {import_error}"]
    if not problems:
        return False
    refusal = UnsupportedRunner("; ".join(problems))
    logger.warning(
        "vllm-hidden-state-proxy: worker hook disabled: this vLLM lacks what it reads: %s. "
        "Flagged requests get 503 from the proxy; ordinary traffic is unaffected.",
        refusal,
    )
    StepCapture.refuse(runner, view, refusal)
    runner.__dict__[_CAPTURE_ATTR] = None
    return True


def capture_for(runner: Any, view: RunnerView) -> StepCapture | None:
    """The runner's capture, created on first use; None (and logged once) if that fails."""
    if _CAPTURE_ATTR in runner.__dict__:
        existing: StepCapture | None = runner.__dict__[_CAPTURE_ATTR]
        return existing
    if _refuse_if_misshapen(runner, view):
        return None
    try:
        capture = StepCapture.for_runner(runner, view)
    except (UnsupportedRunner, RefusedSettings) as error:
        logger.warning(
            "vllm-hidden-state-proxy: worker hook disabled: %s. Flagged requests get 503 from "
            "the proxy; ordinary traffic is unaffected.",
            error,
        )
        capture = None
    except Exception:
        logger.exception(
            "vllm-hidden-state-proxy: worker hook could not start (see the error above); "
            "flagged requests get 503 from the proxy, ordinary traffic is unaffected"
        )
        capture = None
    runner.__dict__[_CAPTURE_ATTR] = capture
    return capture


def _guarded(hook: Callable[..., None], *args: Any) -> None:
    """``hook(*args)``, logging instead of raising: the capture's hooks catch their own
    errors, and this is the last line before vLLM's engine loop, which an exception kills."""
    try:
        hook(*args)
    except Exception:
        logger.exception("vllm-hidden-state-proxy: unexpected error in the worker hook")


def _wrap_execute_model(original: Callable[..., Any], view: RunnerView) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, scheduler_output, *args, **kwargs)
        if kwargs.get("dummy_run"):
            return output
        capture = self.__dict__.get(_CAPTURE_ATTR)
        if capture is None:
            capture = capture_for(self, view)
            if capture is None:
                return output
        _guarded(capture.after_execute_model, self, scheduler_output)
        return output

    return execute_model


def _wrap_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        capture = self.__dict__.get(_CAPTURE_ATTR)
        if capture is not None:
            _guarded(capture.after_sample_tokens, output)
        return output

    return sample_tokens


def _wrap_init(original: Callable[..., Any], view: RunnerView) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # Once per runner, at the one call every vLLM makes: a method the hook cannot wrap
        # would otherwise be found (if ever) only by a flagged request timing out.
        if _CAPTURE_ATTR not in self.__dict__:
            try:
                _refuse_if_misshapen(self, view)
            except Exception:
                logger.exception("vllm-hidden-state-proxy: unexpected error in the worker hook")

    return __init__


def _then(original: Callable[..., Any], after: Callable[[Any], object]) -> Callable[..., Any]:
    """``original``, then ``after(self)``, which never raises (the worker's and the runner's
    ``load_model``, the runner's ``initialize_kv_cache``); ``original``'s result."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self)
        return result

    return wrapper


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps a runner class right after its module is imported, in whichever process does so."""

    def __init__(self, targets: dict[str, Target]) -> None:
        self.targets = targets

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.targets[fullname])
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, target: Target) -> None:
        self.inner = inner
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            _patch_module(module, self.target)
        except Exception:
            logger.exception("vllm-hidden-state-proxy: could not wrap %s", module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
