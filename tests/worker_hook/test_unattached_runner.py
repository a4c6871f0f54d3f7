"""A model runner the hook never attached to (issue #35): vLLM 0.34's non-x86 CPU runner
(``StandaloneCPUModelRunner``, not a subclass of any runner the hook wraps), or a runner vLLM
moved to another module. The worker's wrapped ``load_model`` leaves the engine's failure note,
naming the vLLM version and the runner class, instead of no ring and the proxy's generic 503.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm

from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import FakeV1Runner, fake_vllm_config
from vllm_hidden_state_proxy.ring import RingDirectory
from vllm_hidden_state_proxy.worker_hook import plugin
from vllm_hidden_state_proxy.worker_hook.compat import WRAPPED_ATTR
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView


class MovedRunner:
    """A runner class in a module the hook does not look in (as if vLLM had moved it)."""

    def __init__(self) -> None:
        self.vllm_config = fake_vllm_config()

    def load_model(self) -> None: ...


def worker_class() -> Any:
    """A fresh worker class shaped as vLLM's ``gpu_worker.Worker``, wrapped by the plugin."""

    class Worker:
        def __init__(self, runner: Any, vllm_config: Any = None) -> None:
            self.model_runner = runner
            self.vllm_config = fake_vllm_config() if vllm_config is None else vllm_config
            self.loaded = 0

        def load_model(self, *, load_dummy_weights: bool = False) -> None:
            self.loaded += 1
            self.model_runner.load_model()

    plugin.patch_worker_class(Worker)
    return Worker


def failures(ring_dir: Path) -> list[Any]:
    if not ring_dir.exists():
        return []
    with RingDirectory(ring_dir) as directory:
        return list(directory.failed_engines())


def test_a_runner_of_an_unknown_class_gets_a_note_naming_vllm_and_the_class(
    ring_env: Path, monkeypatch: pytest.MonkeyPatch, hook_log: HookLog
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    worker = worker_class()(MovedRunner())
    worker.load_model()
    assert worker.loaded == 1  # vLLM's own load_model ran
    [failure] = failures(ring_env)
    name = f"{__name__}.MovedRunner"
    assert f"this vLLM built the model runner {name}, which the hook does not attach to" in (
        failure.message
    )
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner" in failure.message
    assert "[vLLM 0.34.0, model runner MovedRunner]" in failure.message
    assert failure.fatal and not failure.refused_settings
    [warning] = [r for r in hook_log.records if r.levelno == logging.WARNING]
    assert "worker hook not attached" in warning.getMessage()
    assert name in warning.getMessage()


def test_an_attached_runner_gets_no_note(ring_env: Path, hook_log: HookLog) -> None:
    class Runner(FakeV1Runner):
        def __init__(self) -> None:
            super().__init__()

        def load_model(self) -> None: ...

    # As the plugin marks a wrapped __init__ (whose own checks are test_plugin's business).
    setattr(Runner.__init__, WRAPPED_ATTR, True)
    worker_class()(Runner()).load_model()
    assert failures(ring_env) == []
    assert [r for r in hook_log.records if "not attached" in r.getMessage()] == []


def test_a_subclass_of_an_attached_runner_is_attached() -> None:
    class Base:
        def __init__(self) -> None: ...

    class Sub(Base): ...

    plugin.patch_runner_class(Base, V1RunnerView(), ("__init__",))
    assert plugin.is_attached(Sub)
    assert not plugin.is_attached(MovedRunner)


def test_an_encoder_only_runner_and_other_ranks_get_no_note(ring_env: Path) -> None:
    encoder_only = fake_vllm_config()
    encoder_only.is_mm_encoder_only = True
    worker_class()(MovedRunner(), encoder_only).load_model()
    tp_rank_1 = fake_vllm_config(
        SimpleNamespace(
            tensor_parallel_size=2,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            rank=1,
            data_parallel_index=0,
        )
    )
    worker_class()(MovedRunner(), tp_rank_1).load_model()
    assert failures(ring_env) == []


def test_a_failing_check_does_not_break_load_model(hook_log: HookLog) -> None:
    worker = worker_class()(MovedRunner(), vllm_config=object())  # no parallel_config
    worker.load_model()  # must not raise
    assert worker.loaded == 1
    assert any(r.levelno == logging.ERROR for r in hook_log.records)


def test_patch_worker_class_is_idempotent() -> None:
    cls = worker_class()
    wrapped = cls.load_model
    plugin.patch_worker_class(cls)
    assert cls.load_model is wrapped


@pytest.mark.skipif(
    importlib.util.find_spec("vllm.v1.worker.cpu.standalone_model_runner") is None,
    reason=f"vLLM {vllm.__version__} has no non-x86 standalone CPU runner",
)
def test_vllms_standalone_cpu_runner_is_one_the_hook_does_not_attach_to(ring_env: Path) -> None:
    """vLLM 0.34's CPU runner off x86 (no Triton, so no V2): its own class, no V2 base."""
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    for module_name, (class_name, *_) in plugin.RUNNER_MODULES.items():
        if importlib.util.find_spec(module_name) is not None:
            module = importlib.import_module(module_name)
            assert not issubclass(StandaloneCPUModelRunner, getattr(module, class_name))
    runner = object.__new__(StandaloneCPUModelRunner)  # its __init__ wants a CPU platform
    runner.load_model = lambda: None
    worker_class()(runner).load_model()
    [failure] = failures(ring_env)
    assert "vllm.v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner" in (
        failure.message
    )
    assert f"vLLM {vllm.__version__}" in failure.message
