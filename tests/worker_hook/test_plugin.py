"""plugin.py: the vllm.general_plugins entry point, runner patching, import hook, rank rule."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    RING_SLOTS_ENV,
)
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.worker_hook import plugin
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.runners import (
    UnsupportedRunner,
    V1RunnerView,
    V2RunnerView,
)

ENTRY_POINT = "vllm_hidden_state_proxy.worker_hook.plugin:register"


# -- version gate and register() ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32", True),
        ("0.32.0", True),
        ("0.32.1", True),
        ("0.32.1.dev12+gabcdef", True),
        ("0.33.0", True),
        ("0.33.0rc1", True),
        ("0.33rc1", False),
        ("0.31.9", False),
        ("0.34.0", False),
        ("0.320.0", False),
        ("0.3", False),
        ("1.32.0", False),
        ("unknown", False),
        ("", False),
    ],
)
def test_is_supported_version(version: str, supported: bool) -> None:
    assert plugin.is_supported_version(version) is supported


def test_installed_vllm_is_supported() -> None:
    assert plugin.is_supported_version(vllm.__version__)


@pytest.fixture
def install_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(plugin, "install_runner_patches", lambda *a: calls.append(a))
    return calls


@pytest.mark.parametrize("value", ["0", "false", "no", "off", " OFF "])
def test_register_disabled_by_env(
    monkeypatch: pytest.MonkeyPatch,
    install_calls: list[Any],
    hook_log: Any,
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


def test_register_unsupported_version_logs_one_line_and_patches_nothing(
    monkeypatch: pytest.MonkeyPatch,
    install_calls: list[Any],
    hook_log: Any,
    clean_meta_path: None,
) -> None:
    monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    before = list(sys.meta_path)
    plugin.register()
    assert install_calls == []
    assert sys.meta_path == before
    [record] = hook_log.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "\n" not in message
    assert "0.29.1" in message
    assert "not a supported" in message
    assert "0.32.x" in message


@pytest.mark.parametrize("value", [None, "1", "yes"])
def test_register_on_supported_version_installs_the_patches(
    monkeypatch: pytest.MonkeyPatch, install_calls: list[Any], value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(HOOK_ENABLED_ENV, raising=False)
    else:
        monkeypatch.setenv(HOOK_ENABLED_ENV, value)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    plugin.register()
    assert install_calls == [()]


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, hook_log: Any) -> None:
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


def test_runner_targets_name_real_vllm_classes() -> None:
    for module_name, (class_name, view) in plugin.RUNNER_MODULES.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        assert callable(cls.execute_model)
        assert callable(cls.initialize_kv_cache)
        assert isinstance(
            view, V2RunnerView if ".gpu.model_runner" in module_name else V1RunnerView
        )


# -- patch_runner_class -------------------------------------------------------------------------


class FakeCapture:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.fail = fail

    def after_execute_model(self, runner: Any, scheduler_output: Any) -> None:
        self.calls.append((runner, scheduler_output))
        if self.fail:
            raise RuntimeError("capture broke")


def make_runner_class() -> type:
    class Runner:
        def __init__(self) -> None:
            self.kv_initialized = False

        def execute_model(
            self, scheduler_output: Any, intermediate_tensors: Any = None, **kw: Any
        ) -> Any:
            return ("output", scheduler_output, intermediate_tensors)

        def initialize_kv_cache(self, config: Any) -> str:
            self.kv_initialized = True
            return "kv-result"

    return Runner


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[FakeCapture]:
    made: list[FakeCapture] = []

    def for_runner(runner: Any, view: Any) -> FakeCapture:
        made.append(FakeCapture())
        return made[-1]

    monkeypatch.setattr(StepCapture, "for_runner", staticmethod(for_runner))
    return made


def test_patch_runner_class_wraps_and_is_idempotent(captures: list[FakeCapture]) -> None:
    cls = make_runner_class()
    original_execute = cls.execute_model
    plugin.patch_runner_class(cls, V1RunnerView())
    wrapped_execute, wrapped_init = cls.execute_model, cls.initialize_kv_cache
    assert wrapped_execute is not original_execute
    assert wrapped_execute.__wrapped__ is original_execute
    plugin.patch_runner_class(cls, V1RunnerView())
    assert cls.execute_model is wrapped_execute
    assert cls.initialize_kv_cache is wrapped_init

    runner = cls()
    assert runner.initialize_kv_cache("cfg") == "kv-result"
    assert runner.kv_initialized
    assert len(captures) == 1  # created once the KV cache exists, before any step
    assert runner.execute_model("so", "it") == ("output", "so", "it")
    assert runner.execute_model(scheduler_output="so2") == ("output", "so2", None)
    assert len(captures) == 1
    assert captures[0].calls == [(runner, "so"), (runner, "so2")]
    # Dummy runs (V2 profiling / warm-up) are not captured.
    assert runner.execute_model("dummy", dummy_run=True) == ("output", "dummy", None)
    assert len(captures[0].calls) == 2


def test_capture_created_lazily_without_initialize_kv_cache(captures: list[FakeCapture]) -> None:
    class Bare:
        def execute_model(self, scheduler_output: Any) -> str:
            return "out"

    plugin.patch_runner_class(Bare, V1RunnerView())
    assert not hasattr(Bare, "initialize_kv_cache")
    runner = Bare()
    assert runner.execute_model("s1") == "out"
    assert runner.execute_model("s2") == "out"
    assert len(captures) == 1
    assert [so for _, so in captures[0].calls] == ["s1", "s2"]


def test_wrapped_execute_model_survives_a_failing_capture_start(
    monkeypatch: pytest.MonkeyPatch, hook_log: Any
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
    assert len(attempts) == 1  # the failure is remembered, not retried every step
    [record] = hook_log.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None


def test_wrapped_execute_model_survives_a_failing_capture_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        StepCapture, "for_runner", staticmethod(lambda runner, view: FakeCapture(fail=True))
    )
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    assert cls().execute_model("so") == ("output", "so", None)


def test_original_exceptions_propagate_unchanged(captures: list[FakeCapture]) -> None:
    class Failing:
        def execute_model(self, scheduler_output: Any) -> Any:
            raise ValueError("vLLM's own error")

    plugin.patch_runner_class(Failing, V1RunnerView())
    with pytest.raises(ValueError, match="vLLM's own error"):
        Failing().execute_model("so")
    assert captures == []


# -- install_runner_patches / _PatchOnImport ----------------------------------------------------

RUNNER_SOURCE = """
class Runner:
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return "out"

    def initialize_kv_cache(self, config):
        return None
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
    return bool(getattr(cls.execute_model, plugin._WRAPPED_ATTR, False))


def test_patch_on_import(throwaway: tuple[str, str], captures: list[FakeCapture]) -> None:
    top, sub = throwaway
    view = V1RunnerView()
    plugin.install_runner_patches({top: ("Runner", view), sub: ("Runner", view)})
    [finder] = hook_finders()
    assert sys.meta_path[0] is finder  # ahead of the path finders that would load it plainly
    assert top not in sys.modules

    top_module = importlib.import_module(top)
    sub_module = importlib.import_module(sub)
    assert is_wrapped(top_module.Runner)
    assert is_wrapped(sub_module.Runner)
    assert getattr(top_module.Runner.initialize_kv_cache, plugin._WRAPPED_ATTR, False)
    assert top_module.Runner().execute_model("so") == "out"
    assert len(captures) == 1
    # Modules that are not targets load normally.
    assert finder.find_spec("json", None) is None


def test_already_imported_module_is_patched_at_once(
    throwaway: tuple[str, str], captures: list[FakeCapture]
) -> None:
    top, _ = throwaway
    module = importlib.import_module(top)
    assert not is_wrapped(module.Runner)
    plugin.install_runner_patches({top: ("Runner", V1RunnerView())})
    assert is_wrapped(module.Runner)
    assert hook_finders() == []  # nothing left to wait for
    # A second install does not double-wrap.
    wrapped = module.Runner.execute_model
    plugin.install_runner_patches({top: ("Runner", V1RunnerView())})
    assert module.Runner.execute_model is wrapped


def test_patching_failure_does_not_break_the_import(
    throwaway: tuple[str, str], hook_log: Any
) -> None:
    top, _ = throwaway
    plugin.install_runner_patches({top: ("NoSuchRunner", V1RunnerView())})
    module = importlib.import_module(top)  # must not raise
    assert not is_wrapped(module.Runner)
    [record] = hook_log.records
    assert top in record.getMessage()


# -- the rank rule ------------------------------------------------------------------------------


def fake_runner(dp_rank: int = 0, prefill_context_parallel_size: int = 1) -> SimpleNamespace:
    """What StepCapture.for_runner and V1RunnerView.check read from a V1 runner."""
    model_config = SimpleNamespace(
        served_model_name=["served-name", "alias"],
        model="org/model",
        get_hidden_size=lambda: 8,
    )
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=model_config,
            parallel_config=SimpleNamespace(
                data_parallel_rank=dp_rank,
                prefill_context_parallel_size=prefill_context_parallel_size,
            ),
        ),
        input_batch=SimpleNamespace(
            req_id_to_index={}, num_computed_tokens_cpu=[], num_prompt_tokens=[]
        ),
        query_start_loc=SimpleNamespace(np=[0]),
    )


@pytest.fixture
def ring_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    ring_dir = tmp_path / "rings"
    monkeypatch.setenv(RING_DIR_ENV, str(ring_dir))
    monkeypatch.setenv(RING_SLOTS_ENV, "8")
    monkeypatch.delenv(RING_DIR_MODE_ENV, raising=False)
    return ring_dir


def set_ranks(monkeypatch: pytest.MonkeyPatch, tp_rank: int, last_pp: bool) -> None:
    from vllm.distributed import parallel_state

    monkeypatch.setattr(
        parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp_rank)
    )
    monkeypatch.setattr(
        parallel_state, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_pp)
    )


@pytest.mark.parametrize(
    ("tp_rank", "last_pp", "publishes"),
    [(0, True, True), (1, True, False), (0, False, False), (1, False, False)],
)
def test_only_tp_rank_0_of_the_last_pp_stage_publishes(
    monkeypatch: pytest.MonkeyPatch,
    ring_env: Path,
    tp_rank: int,
    last_pp: bool,
    publishes: bool,
) -> None:
    set_ranks(monkeypatch, tp_rank, last_pp)
    capture = StepCapture.for_runner(fake_runner(), V1RunnerView())
    try:
        assert capture.publishing is publishes
        assert capture.model_name == "served-name"
        ring_file = ring_env / "ring-dp0.bin"
        assert ring_file.exists() is publishes
        if publishes:
            assert capture.writer.path == ring_file
            with RingReader.open(ring_file) as reader:
                assert reader.hidden_size == 8
                assert reader.slot_count == 8
    finally:
        if capture.writer is not None:
            capture.writer.close()


def test_ring_exists_after_initialize_kv_cache_before_any_request(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path
) -> None:
    set_ranks(monkeypatch, 0, True)
    cls = make_runner_class()
    plugin.patch_runner_class(cls, V1RunnerView())
    runner = cls()
    runner.__dict__.update(vars(fake_runner(dp_rank=3)))
    runner.initialize_kv_cache("cfg")
    capture = runner.__dict__[plugin._CAPTURE_ATTR]
    try:
        assert (ring_env / "ring-dp3.bin").exists()
        # An idle step goes through the real capture without publishing anything.
        empty = SchedulerOutput.make_empty()
        assert runner.execute_model(empty) == ("output", empty, None)
        assert capture.writer.publish_count == 0
    finally:
        capture.writer.close()


def test_a_runner_without_the_expected_state_disables_the_hook_before_any_ring_exists(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path, hook_log: Any
) -> None:
    set_ranks(monkeypatch, 0, True)
    runner = fake_runner()
    del runner.input_batch.num_prompt_tokens  # e.g. a vLLM version that renamed it
    assert plugin.capture_for(runner, V1RunnerView()) is None
    assert not ring_env.exists() or not any(ring_env.iterdir())
    text = " ".join(r.getMessage() for r in hook_log.records)
    assert "worker hook disabled" in text and "num_prompt_tokens" in text


def test_prefill_context_parallelism_disables_the_hook(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path, hook_log: Any
) -> None:
    set_ranks(monkeypatch, 0, True)
    runner = fake_runner(prefill_context_parallel_size=2)
    assert plugin.capture_for(runner, V1RunnerView()) is None
    assert not ring_env.exists() or not any(ring_env.iterdir())
    assert any("prefill_context_parallel_size=2" in r.getMessage() for r in hook_log.records)


def test_v2_view_check_accepts_vllms_real_v2_classes() -> None:
    runner = SimpleNamespace(
        vllm_config=object(),
        req_states=SimpleNamespace(prompt_len=SimpleNamespace(np=[0])),
    )
    V2RunnerView().check(runner)
    with pytest.raises(UnsupportedRunner, match="prompt_len"):
        V2RunnerView().check(SimpleNamespace(vllm_config=object(), req_states=object()))
