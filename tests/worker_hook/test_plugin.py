"""plugin.py: the vllm.general_plugins entry point, runner patching, import hook, and that a
hook which cannot start never raises into vLLM."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.v1.core.sched.output import SchedulerOutput

from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import (
    FINAL,
    HAS_V1,
    FakeV1Runner,
    key,
    needs_v1,
    record_of,
    row_vector,
    sched,
)
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV, LAYERS_ENV, RING_SLOTS_ENV
from vllm_hidden_state_proxy.ring import RingDirectory, RingReader
from vllm_hidden_state_proxy.ring.files import note_name, ring_name
from vllm_hidden_state_proxy.ring.notes import read_live_note
from vllm_hidden_state_proxy.worker_hook import plugin
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.compat import NEEDED_METHODS
from vllm_hidden_state_proxy.worker_hook.engine import instance_of
from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers
from vllm_hidden_state_proxy.worker_hook.ring_start import LAYERS_ATTR
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView, V2RunnerView

ENTRY_POINT = "vllm_hidden_state_proxy.worker_hook.plugin:register"


# -- register() ---------------------------------------------------------------------------------


@pytest.fixture
def install_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(plugin, "install_runner_patches", lambda *a: calls.append(a))
    return calls


@pytest.mark.parametrize("value", ["0", "false", "no", "off", " OFF "])
def test_register_disabled_by_env(
    monkeypatch: pytest.MonkeyPatch,
    install_calls: list[Any],
    hook_log: HookLog,
    clean_meta_path: None,
    value: str,
) -> None:
    monkeypatch.setenv(HOOK_ENABLED_ENV, value)
    before = list(sys.meta_path)
    plugin.register()
    assert install_calls == []
    assert sys.meta_path == before
    assert len(hook_log.records) == 1
    assert HOOK_ENABLED_ENV in hook_log.records[0].getMessage()


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.40.0", "1.0.0", "unknown"])
@pytest.mark.parametrize("value", [None, "", "auto", "1", "yes", "on", "something else"])
def test_register_installs_the_patches_on_any_version_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
    install_calls: list[Any],
    hook_log: HookLog,
    version: str,
    value: str | None,
) -> None:
    """The version number decides nothing here: the worker's structural checks do, where a
    failure note can say so (a number checked here could only switch the hook off silently)."""
    if value is None:
        monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)
    else:
        monkeypatch.setenv(HOOK_ENABLED_ENV, value)
    monkeypatch.setattr(vllm, "__version__", version)
    plugin.register()
    assert install_calls == [()]
    assert hook_log.records == []  # register() runs in every vLLM process: it stays quiet


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, hook_log: HookLog) -> None:
    def boom(*args: Any) -> None:
        raise RuntimeError("broken")

    monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setattr(plugin, "install_runner_patches", boom)
    plugin.register()
    [record] = hook_log.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None


def test_entry_point_is_installed() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == ENTRY_POINT]
    assert len(ours) == 1
    assert ours[0].name == "hidden_state_hook"
    assert ours[0].load() is plugin.register


def test_vllm_discovers_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import load_plugins_by_group

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert load_plugins_by_group("vllm.general_plugins")["hidden_state_hook"] is plugin.register


# -- the runner classes of the installed vLLM ----------------------------------------------------


def test_runner_targets_name_real_vllm_classes() -> None:
    found = []
    for module_name, (class_name, view, methods) in plugin.RUNNER_MODULES.items():
        if importlib.util.find_spec(module_name) is None:
            assert not HAS_V1 and module_name.startswith("vllm.v1.worker.")  # V1, gone in 0.34
            continue
        found.append(module_name)
        cls = getattr(importlib.import_module(module_name), class_name)
        # Each wrapped method is the class's own: a wrapper on an inherited one would be lost.
        for name in methods:
            assert name in cls.__dict__, f"{class_name}.{name} is inherited in {module_name}"
            assert callable(getattr(cls, name))
        assert isinstance(
            view, V2RunnerView if ".gpu.model_runner" in module_name else V1RunnerView
        )
    assert "vllm.v1.worker.gpu.model_runner" in found


def test_worker_targets_name_real_vllm_classes() -> None:
    for module_name, class_name in plugin.WORKER_MODULES.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        assert "load_model" in cls.__dict__, f"{class_name}.load_model is inherited"
    # The CPU worker builds its runner through the GPU worker's load_model.
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert "load_model" not in CPUWorker.__dict__


@needs_v1
def test_the_cpu_runner_reaches_the_v1_runners_wrapped_methods() -> None:
    """The CPU runner's own load_model does not call the V1 one (so it is wrapped itself); its
    other methods are the V1 runner's, or call them."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cpu_target = plugin.RUNNER_MODULES["vllm.v1.worker.cpu_model_runner"]
    assert cpu_target[2] == ("load_model",)
    assert issubclass(CPUModelRunner, GPUModelRunner)
    assert "super().load_model" not in inspect.getsource(CPUModelRunner.__dict__["load_model"])
    for name in ("execute_model", "sample_tokens"):
        assert name not in CPUModelRunner.__dict__
    own = CPUModelRunner.__dict__.get("initialize_kv_cache")
    if own is not None:
        assert "super().initialize_kv_cache(" in inspect.getsource(own)


# -- patch_runner_class -------------------------------------------------------------------------


class FakeCapture:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.outputs: list[Any] = []
        self.fail = fail

    def after_execute_model(self, runner: Any, scheduler_output: Any) -> None:
        self.calls.append((runner, scheduler_output))
        if self.fail:
            raise RuntimeError("capture broke")

    def after_sample_tokens(self, output: Any) -> None:
        self.outputs.append(output)
        if self.fail:
            raise RuntimeError("capture broke")


class RunnerMethods(FakeV1Runner):
    """The four methods the plugin wraps, declared for the type checker (each runner class of
    :func:`make_runner_class` defines its own, which is what gets wrapped)."""

    kv_initialized = False

    def load_model(self, load_dummy_weights: bool = False) -> str:
        raise NotImplementedError

    def initialize_kv_cache(self, config: Any) -> str:
        raise NotImplementedError

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: Any = None, **kw: Any
    ) -> Any:
        raise NotImplementedError

    def sample_tokens(self, grammar_output: Any) -> str:
        raise NotImplementedError


def make_runner_class() -> type[RunnerMethods]:
    """A fresh runner class defining the four wrapped methods, with the state the capture
    reads."""

    class Runner(RunnerMethods):
        def load_model(self, load_dummy_weights: bool = False) -> str:
            return "loaded"

        def initialize_kv_cache(self, config: Any) -> str:
            self.kv_initialized = True
            return "kv-result"

        def execute_model(
            self, scheduler_output: Any, intermediate_tensors: Any = None, **kw: Any
        ) -> Any:
            return ("output", scheduler_output, intermediate_tensors)

        def sample_tokens(self, grammar_output: Any) -> str:
            return f"sampled({grammar_output})"

    return Runner


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[FakeCapture]:
    made: list[FakeCapture] = []

    def for_runner(runner: Any, view: Any) -> FakeCapture:
        made.append(FakeCapture())
        return made[-1]

    monkeypatch.setattr(StepCapture, "for_runner", staticmethod(for_runner))
    return made


@pytest.fixture
def prepared(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    runners: list[Any] = []
    monkeypatch.setattr(plugin, "prepare_layers", runners.append)
    return runners


def wrapped(method: Any) -> bool:
    return bool(getattr(method, plugin._WRAPPED_ATTR, False))


def test_patch_runner_class_wraps_and_is_idempotent(
    captures: list[FakeCapture], prepared: list[Any]
) -> None:
    cls = make_runner_class()
    originals = {name: cls.__dict__[name] for name in NEEDED_METHODS}
    plugin.patch_runner_class(cls, V1RunnerView())
    wrappers = {name: cls.__dict__[name] for name in NEEDED_METHODS}
    for name in NEEDED_METHODS:
        assert wrappers[name] is not originals[name]
        assert wrappers[name].__wrapped__ is originals[name]
        assert wrapped(wrappers[name])
    assert "__init__" not in cls.__dict__  # not defined there: not wrapped there
    plugin.patch_runner_class(cls, V1RunnerView())
    assert {name: cls.__dict__[name] for name in NEEDED_METHODS} == wrappers

    runner = cls()
    assert runner.load_model() == "loaded"
    assert prepared == [runner]  # the layers are asked for right after loading
    assert runner.initialize_kv_cache("cfg") == "kv-result"
    assert runner.kv_initialized
    assert len(captures) == 1  # created once the KV cache exists, before any step
    assert runner.execute_model("so", "it") == ("output", "so", "it")
    assert runner.execute_model(scheduler_output="so2") == ("output", "so2", None)
    assert runner.sample_tokens("g") == "sampled(g)"
    assert len(captures) == 1
    assert captures[0].calls == [(runner, "so"), (runner, "so2")]
    assert captures[0].outputs == ["sampled(g)"]
    # Dummy runs (V2 profiling / warm-up) are not captured.
    assert runner.execute_model("dummy", dummy_run=True) == ("output", "dummy", None)
    assert len(captures[0].calls) == 2


def test_only_the_given_methods_the_class_defines_itself_are_wrapped(
    captures: list[FakeCapture], prepared: list[Any]
) -> None:
    base = make_runner_class()
    plugin.patch_runner_class(base, V1RunnerView())

    class CPULike(base):  # type: ignore[valid-type, misc]
        def load_model(self, load_dummy_weights: bool = False) -> str:
            return "cpu-loaded"  # does not call the base one

        def initialize_kv_cache(self, config: Any) -> str:
            return "cpu-" + str(super().initialize_kv_cache(config))

    own_init = CPULike.__dict__["initialize_kv_cache"]
    plugin.patch_runner_class(CPULike, V1RunnerView(), ("load_model",))
    assert wrapped(CPULike.__dict__["load_model"])
    assert CPULike.__dict__["initialize_kv_cache"] is own_init  # not asked for
    assert "execute_model" not in CPULike.__dict__  # inherited, wrapped on the base
    # Patching again (another import hook pass) leaves each method wrapped once.
    plugin.patch_runner_class(CPULike, V1RunnerView(), ("load_model",))
    assert not wrapped(CPULike.__dict__["load_model"].__wrapped__)

    runner = CPULike()
    assert runner.load_model() == "cpu-loaded"
    assert prepared == [runner]
    assert runner.initialize_kv_cache("cfg") == "cpu-kv-result"
    assert len(captures) == 1  # through the base's wrapper
    runner.execute_model("so")
    assert captures[0].calls == [(runner, "so")]


def test_a_class_missing_a_wrapped_method_gets_no_capture_and_says_so(
    captures: list[FakeCapture], hook_log: HookLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM whose runner lost ``sample_tokens`` (or moved it where the hook does not wrap
    it) would publish late or never: the hook stays out, and the engine's note says why."""
    refusals: list[tuple[Any, Exception]] = []
    monkeypatch.setattr(
        StepCapture, "refuse", staticmethod(lambda r, view, error: refusals.append((r, error)))
    )

    class Bare(FakeV1Runner):
        def execute_model(self, scheduler_output: Any) -> str:
            return "out"

    plugin.patch_runner_class(Bare, V1RunnerView())
    assert wrapped(Bare.__dict__["execute_model"])
    runner = Bare()
    assert runner.execute_model("s1") == "out"
    assert runner.execute_model("s2") == "out"
    assert captures == []
    [(refused, error)] = refusals  # once, not every step
    assert refused is runner
    for name in ("load_model", "initialize_kv_cache", "sample_tokens"):
        assert f"Bare has no method {name}" in str(error)
    [record] = hook_log.records
    assert record.levelno == logging.WARNING
    assert "Bare has no method sample_tokens" in record.getMessage()


def test_an_init_wrapper_checks_the_class_before_any_step(
    captures: list[FakeCapture], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs in ``__init__`` (every vLLM constructs its runner), so a runner whose
    ``initialize_kv_cache`` is gone is refused before its first request, not at it."""
    refusals: list[Exception] = []
    monkeypatch.setattr(
        StepCapture, "refuse", staticmethod(lambda r, view, error: refusals.append(error))
    )

    class NoKvInit(FakeV1Runner):
        def __init__(self) -> None:
            super().__init__()

        def load_model(self) -> None:
            return None

        def execute_model(self, scheduler_output: Any) -> str:
            return "out"

        def sample_tokens(self, grammar_output: Any) -> None:
            return None

    plugin.patch_runner_class(NoKvInit, V1RunnerView())
    assert wrapped(NoKvInit.__dict__["__init__"])
    runner = NoKvInit()
    [error] = refusals
    assert str(error) == "NoKvInit has no method initialize_kv_cache"
    assert runner.__dict__[plugin._CAPTURE_ATTR] is None
    runner.execute_model("so")
    assert captures == [] and len(refusals) == 1


def test_sample_tokens_before_any_capture_is_left_alone(captures: list[FakeCapture]) -> None:
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    runner = cls()
    assert runner.sample_tokens("g") == "sampled(g)"
    assert captures == []  # sample_tokens does not create the capture


def test_wrapped_methods_survive_a_failing_capture_start(
    monkeypatch: pytest.MonkeyPatch, hook_log: HookLog
) -> None:
    attempts = []

    def for_runner(runner: Any, view: Any) -> Any:
        attempts.append(runner)
        raise PermissionError("ring directory not writable")

    monkeypatch.setattr(StepCapture, "for_runner", staticmethod(for_runner))
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    runner = cls()
    assert runner.initialize_kv_cache("cfg") == "kv-result"
    assert runner.execute_model("so") == ("output", "so", None)
    assert runner.execute_model("so") == ("output", "so", None)
    assert runner.sample_tokens("g") == "sampled(g)"
    assert len(attempts) == 1  # the failure is remembered, not retried every step
    [record] = hook_log.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None


def test_wrapped_methods_survive_a_failing_capture_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        StepCapture, "for_runner", staticmethod(lambda runner, view: FakeCapture(fail=True))
    )
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    runner = cls()
    assert runner.execute_model("so") == ("output", "so", None)
    assert runner.sample_tokens("g") == "sampled(g)"


def test_original_exceptions_propagate_unchanged(
    captures: list[FakeCapture], prepared: list[Any]
) -> None:
    class Failing:
        def load_model(self) -> None:
            raise MemoryError("vLLM's own load error")

        def execute_model(self, scheduler_output: Any) -> Any:
            raise ValueError("vLLM's own error")

    plugin.patch_runner_class(Failing, V1RunnerView())
    with pytest.raises(MemoryError, match="vLLM's own load error"):
        Failing().load_model()
    with pytest.raises(ValueError, match="vLLM's own error"):
        Failing().execute_model("so")
    assert captures == []
    assert prepared == []  # nothing is asked of a model that did not load


# -- install_runner_patches / _PatchOnImport ----------------------------------------------------

RUNNER_SOURCE = """
class Runner:
    def load_model(self):
        return "loaded"

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return "out"

    def initialize_kv_cache(self, config):
        return None

    def sample_tokens(self, grammar_output):
        return "sampled"
"""


@pytest.fixture
def throwaway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_meta_path: None
) -> Iterator[tuple[str, str]]:
    """A fresh top-level module and a package submodule, importable from tmp_path."""
    tag = uuid.uuid4().hex[:8]
    top, pkg = f"hsp_runner_{tag}", f"hsp_pkg_{tag}"
    (tmp_path / f"{top}.py").write_text(RUNNER_SOURCE)
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "model_runner.py").write_text(RUNNER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield top, f"{pkg}.model_runner"
    finally:
        for name in (top, pkg, f"{pkg}.model_runner"):
            sys.modules.pop(name, None)


def hook_finders() -> list[Any]:
    return [f for f in sys.meta_path if isinstance(f, plugin._PatchOnImport)]


def is_wrapped(cls: type) -> bool:
    return wrapped(cls.__dict__["execute_model"])


def test_patch_on_import(throwaway: tuple[str, str], captures: list[FakeCapture]) -> None:
    top, sub = throwaway
    view = V1RunnerView()
    plugin.install_runner_patches(
        {top: ("Runner", view, plugin.ALL_METHODS), sub: ("Runner", view, ("load_model",))}
    )
    [finder] = hook_finders()
    assert sys.meta_path[0] is finder  # ahead of the path finders that would load it plainly
    assert top not in sys.modules

    top_module = importlib.import_module(top)
    sub_module = importlib.import_module(sub)
    assert is_wrapped(top_module.Runner)
    assert wrapped(top_module.Runner.initialize_kv_cache)
    assert wrapped(top_module.Runner.load_model)
    # Only the methods named for that module.
    assert wrapped(sub_module.Runner.load_model)
    assert not is_wrapped(sub_module.Runner)
    assert top_module.Runner().execute_model("so") == "out"
    assert len(captures) == 1
    # Modules that are not targets load normally.
    assert finder.find_spec("json", None) is None


def test_a_second_install_joins_the_existing_finder(
    throwaway: tuple[str, str], captures: list[FakeCapture]
) -> None:
    top, sub = throwaway
    plugin.install_runner_patches({top: ("Runner", V1RunnerView(), plugin.ALL_METHODS)})
    plugin.install_runner_patches({sub: ("Runner", V1RunnerView(), plugin.ALL_METHODS)})
    [finder] = hook_finders()
    assert set(finder.targets) == {top, sub}
    assert is_wrapped(importlib.import_module(sub).Runner)


def test_already_imported_module_is_patched_at_once(
    throwaway: tuple[str, str], captures: list[FakeCapture]
) -> None:
    top, _ = throwaway
    module = importlib.import_module(top)
    assert not is_wrapped(module.Runner)
    plugin.install_runner_patches({top: ("Runner", V1RunnerView(), plugin.ALL_METHODS)})
    assert is_wrapped(module.Runner)
    assert hook_finders() == []  # nothing left to wait for
    # A second install does not double-wrap.
    wrapped_execute = module.Runner.execute_model
    plugin.install_runner_patches({top: ("Runner", V1RunnerView(), plugin.ALL_METHODS)})
    assert module.Runner.execute_model is wrapped_execute


def test_patching_failure_does_not_break_the_import(
    throwaway: tuple[str, str], hook_log: HookLog
) -> None:
    top, _ = throwaway
    plugin.install_runner_patches({top: ("NoSuchRunner", V1RunnerView(), plugin.ALL_METHODS)})
    module = importlib.import_module(top)  # must not raise
    assert not is_wrapped(module.Runner)
    [record] = hook_log.records
    assert top in record.getMessage()


# -- the real capture behind the wrappers ---------------------------------------------------------


def patched_runner(engine: int = 0, **kw: Any) -> RunnerMethods:
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    runner = cls(**kw)
    runner.vllm_config.parallel_config.data_parallel_index = engine
    return runner


def test_the_ring_exists_after_initialize_kv_cache_before_any_request(ring_env: Path) -> None:
    runner = patched_runner(engine=3)
    assert runner.load_model() == "loaded"
    assert runner.__dict__[LAYERS_ATTR] == CapturedLayers(FINAL, (FINAL,))
    runner.initialize_kv_cache("cfg")
    capture = runner.__dict__[plugin._CAPTURE_ATTR]
    try:
        instance = instance_of(runner.vllm_config)
        assert capture.writer.path == ring_env / ring_name(instance, 3)
        with RingReader.open(capture.writer.path) as ring:
            assert ring.header.engine == 3
        # An idle step goes through the real capture without publishing anything.
        empty = SchedulerOutput.make_empty()
        assert runner.execute_model(empty) == ("output", empty, None)
        assert capture.writer.publish_count() == 0
        # A flagged request: published before sample_tokens returns (CPU).
        batch = [("a", 3, 0, 3)]
        runner.load(batch)
        so = sched(batch, new={"a": key(1)})
        assert runner.execute_model(so) == ("output", so, None)
        assert runner.sample_tokens("g") == "sampled(g)"
        with RingDirectory(ring_env) as directory:
            assert record_of(directory.lookup(key(1))).vector(FINAL) == row_vector(2)
    finally:
        capture.writer.close()


@pytest.mark.parametrize(
    "cause",
    ["ring directory is a file", "unsupported runner", "uncapturable layers", "no slots"],
)
def test_a_hook_that_cannot_start_never_raises_into_vllm(
    ring_env: Path, monkeypatch: pytest.MonkeyPatch, hook_log: HookLog, cause: str
) -> None:
    runner = patched_runner(engine=2, model=object())
    expected = ""
    if cause == "ring directory is a file":
        ring_env.parent.mkdir(parents=True, exist_ok=True)
        ring_env.write_text("")
    elif cause == "unsupported runner":  # e.g. a vLLM version that renamed it
        query_start_loc = runner.query_start_loc
        del runner.query_start_loc
        expected = "UnsupportedRunner: the V1 model runner has no query_start_loc"
    elif cause == "uncapturable layers":
        monkeypatch.setenv(LAYERS_ENV, "1")
        expected = "LayerConfigError: object does not support auxiliary hidden-state outputs"
    else:
        monkeypatch.setenv(RING_SLOTS_ENV, "0")
        expected = "ValueError: slot_count must be in [1, "

    assert runner.load_model() == "loaded"
    assert runner.initialize_kv_cache("cfg") == "kv-result"
    if cause == "unsupported runner":
        runner.query_start_loc = query_start_loc  # only so that the fake can lay out a step
    batch = [("a", 3, 0, 3)]
    runner.load(batch)
    so = sched(batch, new={"a": key(1)})
    assert runner.execute_model(so) == ("output", so, None)
    assert runner.sample_tokens("g") == "sampled(g)"
    assert runner.execute_model(so) == ("output", so, None)

    assert runner.__dict__[plugin._CAPTURE_ATTR] is None  # disabled, and not retried
    assert not ring_env.is_dir() or not any(ring_env.glob("*.bin"))
    note_path = ring_env / note_name(instance_of(runner.vllm_config), 2)
    if not expected:  # nowhere to leave a note: the logs say why
        assert ring_env.is_file()
        assert any(
            "is not a directory" in r.getMessage() and "no failure note" in r.getMessage()
            for r in hook_log.records
        )
        return
    note = read_live_note(note_path, None)
    assert note is not None
    assert note.engine == 2
    assert note.message.startswith(expected)
    with RingDirectory(ring_env) as directory:
        [failure] = directory.failed_engines()
        assert failure.describe().startswith("engine 2 (data-parallel index) of vLLM instance")
    disabled = [r for r in hook_log.records if r.levelno >= logging.WARNING]
    assert any("worker hook" in r.getMessage() for r in disabled)
