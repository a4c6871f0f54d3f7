"""Which devices the tests of this folder run on, and why CUDA is skipped where it is.

Every test of the capture pipeline takes a ``device`` parameter: ``"cpu"`` runs everywhere (CI:
the synchronous copier, the same fakes, the same checks), ``"cuda"`` runs where torch sees a CUDA
device (the asynchronous copier, pinned buffers, events, streams, CUDA graphs) and is skipped with
:data:`CUDA_MISSING` elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def cuda_missing() -> str | None:
    """Why the CUDA tests cannot run here; ``None`` if they can."""
    build = torch.version.cuda
    if build is None:
        return (
            f"no CUDA device: torch {torch.__version__} is a CPU build (the GPU tests run on a "
            "CUDA machine: python3 tests/gpu/run.py, CONTRIBUTING.md)"
        )
    if not torch.cuda.is_available():
        return (
            f"no CUDA device: torch {torch.__version__} (CUDA {build}) sees none (the GPU tests "
            "run on a CUDA machine: python3 tests/gpu/run.py, CONTRIBUTING.md)"
        )
    return None


CUDA_MISSING = cuda_missing()
#: For tests that only mean something on CUDA (streams, graphs, pinned memory in flight).
needs_cuda = pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")
#: ``pytest.mark.parametrize("device", DEVICES)``: the CPU counterpart and the CUDA test.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=needs_cuda),
]


def device_of(name: str) -> Any:
    """``torch.device`` of a ``DEVICES`` parameter (``cuda`` is the current CUDA device)."""
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def synchronize(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sleep_on_stream(device: Any, microseconds: float) -> None:
    """Keep ``device``'s current stream busy for about ``microseconds`` (nothing on CPU).

    The host then runs ahead of the device, as it does under vLLM: what the hook enqueues after
    a step is still waiting on the device when the next step is enqueued, so a copy that were
    not ordered behind its step, or a buffer handed out while its copy is in flight, shows.
    """
    if device.type == "cuda" and microseconds > 0:
        # torch.cuda._sleep spins for a number of SM clock cycles; 2 GHz is an H200's boost
        # clock, so at a lower clock it sleeps longer, which only makes the lag larger.
        torch.cuda._sleep(int(microseconds * 2000))
