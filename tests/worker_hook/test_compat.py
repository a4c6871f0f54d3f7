"""compat.py: the version policy by structure and the structural checks, on small classes and
on the installed vLLM's real runner classes. (The hook's on/off switch: test_settings.py.)"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import vllm

from tests.worker_hook.fakes import HAS_V1, needs_v1
from vllm_hidden_state_proxy.worker_hook import plugin
from vllm_hidden_state_proxy.worker_hook.compat import (
    NEEDED_METHODS,
    WRAPPED_ATTR,
    describe_vllm,
    is_tested_version,
    scheduler_problems,
    unwrapped_methods,
)
from vllm_hidden_state_proxy.worker_hook.runners import structure_problems


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("0.32", True),
        ("0.32.0", True),
        ("0.32.1.dev12+gabcdef", True),
        ("0.33.0", True),
        ("0.33.0rc1", True),
        ("0.33rc1", False),
        ("0.31.9", False),
        ("0.34.0", True),
        ("0.35.0", False),
        ("0.320.0", False),
        ("1.32.0", False),
        ("unknown", False),
        ("", False),
    ],
)
def test_is_tested_version(version: str, tested: bool) -> None:
    assert is_tested_version(version) is tested
    assert describe_vllm(version).endswith("(untested by this hook)") is not tested


def wrapper(function: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    setattr(wrapped, WRAPPED_ATTR, True)
    return wrapped


class Base:
    @wrapper
    def load_model(self) -> None: ...

    @wrapper
    def initialize_kv_cache(self) -> None: ...

    @wrapper
    def execute_model(self) -> None: ...

    @wrapper
    def sample_tokens(self) -> None: ...


def test_a_class_whose_methods_are_all_wrapped_passes() -> None:
    assert unwrapped_methods(Base) == []


def test_an_override_that_calls_the_base_passes_one_that_does_not_is_named() -> None:
    class Calls(Base):
        def initialize_kv_cache(self) -> None:
            super().initialize_kv_cache()

    class Skips(Base):
        def sample_tokens(self) -> None:
            return None

    assert unwrapped_methods(Calls) == []
    assert unwrapped_methods(Skips) == [
        "Skips.sample_tokens is not one the hook wraps, and it does not call one"
    ]


def test_a_method_inherited_from_an_unwrapped_base_is_named() -> None:
    class Mixin:
        def sample_tokens(self) -> None: ...

    class Runner(Mixin):
        load_model = Base.load_model
        initialize_kv_cache = Base.initialize_kv_cache
        execute_model = Base.execute_model

    assert unwrapped_methods(Runner) == [
        "Runner.sample_tokens (inherited from Mixin) is not one the hook wraps, and it does "
        "not call one"
    ]


def test_a_missing_method_is_named() -> None:
    class Runner:
        load_model = Base.load_model

    assert unwrapped_methods(Runner) == [
        f"Runner has no method {name}" for name in NEEDED_METHODS if name != "load_model"
    ]


def test_the_installed_vllms_scheduler_output_has_what_the_hook_reads() -> None:
    assert scheduler_problems() == []


@pytest.fixture
def wrapped_vllm_runners(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    """The installed vLLM's runner classes with each target method marked as the plugin would
    wrap it (monkeypatch restores them: no other test sees wrapped vLLM classes)."""
    classes = {}
    for module_name, (class_name, _view, methods) in plugin.RUNNER_MODULES.items():
        if importlib.util.find_spec(module_name) is None:  # V1's, from vLLM 0.34 on
            continue
        cls = getattr(importlib.import_module(module_name), class_name)
        for name in methods:
            if name != "__init__" and name in cls.__dict__:
                monkeypatch.setattr(cls, name, wrapper(cls.__dict__[name]))
        classes[module_name] = cls
    return classes


def test_the_installed_vllms_runners_pass_the_structural_checks(
    wrapped_vllm_runners: dict[str, type],
) -> None:
    assert "vllm.v1.worker.gpu.model_runner" in wrapped_vllm_runners  # V2, in every version
    assert ("vllm.v1.worker.gpu_model_runner" in wrapped_vllm_runners) is HAS_V1
    for module_name, cls in wrapped_vllm_runners.items():
        view = plugin.RUNNER_MODULES[module_name][1]
        assert structure_problems(cls, view) == [], module_name


def test_the_installed_vllms_v2_cpu_runner_passes_the_structural_checks(
    wrapped_vllm_runners: dict[str, type],
) -> None:
    """The x86 CPU runner of V2 (``vllm.v1.worker.cpu.model_runner``, the only CPU runner of
    vLLM 0.34 on x86) is a subclass of V2's GPU runner: it reaches the wrappers through it."""
    if importlib.util.find_spec("vllm.v1.worker.cpu.model_runner") is None:
        pytest.skip(f"vLLM {vllm.__version__} has no V2 CPU runner")
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    view = plugin.RUNNER_MODULES["vllm.v1.worker.gpu.model_runner"][1]
    assert issubclass(CPUModelRunner, wrapped_vllm_runners["vllm.v1.worker.gpu.model_runner"])
    assert structure_problems(CPUModelRunner, view) == []


@needs_v1
def test_a_cpu_runner_that_stopped_calling_the_base_is_refused(
    wrapped_vllm_runners: dict[str, type], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU runner's own ``initialize_kv_cache`` calls the V1 one today; a release in which
    it no longer did would never create the ring there."""
    cpu = wrapped_vllm_runners["vllm.v1.worker.cpu_model_runner"]

    def initialize_kv_cache(self: Any, *args: Any) -> None:
        return None

    monkeypatch.setattr(cpu, "initialize_kv_cache", initialize_kv_cache)
    view = plugin.RUNNER_MODULES["vllm.v1.worker.cpu_model_runner"][1]
    [problem] = structure_problems(cpu, view)
    assert problem.startswith("CPUModelRunner.initialize_kv_cache is not one the hook wraps")
