"""A stand-in model whose hidden states are exact and known beforehand, on any device.

Each row of a step is one token: its *seed* names the prompt (or, past the prompt, the choice)
and the position, so a position computed again (chunked prefill, preemption) gets the same rows,
as with a real model, and siblings of ``n > 1`` share their prompt's rows. From the seed:

- ``x``: ``[T, hidden]`` small integers (-8..8), computed on the device from the seeds;
- layer 0 (an auxiliary output) is ``x``, layer 2 is ``3 x``, the final layer is ``x @ W``
  with ``W`` of -1, 0 and 1: a float32 matmul of integers whose sums stay below 2**24, so it is
  exact on any device, in any summation order, TF32 or not. Each layer is then held in the
  model's dtype (float32, bfloat16, float16), rounded once.

So :meth:`MatmulModel.reference` gives every row, as held in the model's dtype, in float64 on
the host, without running the model; a copied row that is not its step's shows at once.

The forward writes into static buffers that the next step overwrites, as vLLM's CUDA graphs do
(V2's ``ModelCudaGraphManager`` returns views of its static ``hidden_states``): with
``graph=True`` (CUDA) the matmul and the layers' casts are captured once in a
``torch.cuda.CUDAGraph`` and replayed every step on the current stream, after the step's seeds
were copied into the static input, as V2 prepares a step's inputs before its replay.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers

#: The fake model's decoder layer count N: layer N is the final layer.
FINAL = 4
#: What the fake server captures: two intermediate layers and the final one.
CAPTURED = CapturedLayers(FINAL, (0, 2, FINAL))
MODEL = "gpu-test-model"

_MIX = 2654435761  # Knuth's multiplicative hash; seed * _MIX stays below 2**63
_COLUMN = 40503


def seed_of(identity: str, position: int) -> int:
    """The seed of ``identity``'s (a prompt's, or a choice's) row at ``position``."""
    return (zlib.crc32(identity.encode()) * 1_000_003 + position) % (1 << 31)


def _x_numpy(seeds: np.ndarray[Any, Any], hidden: int) -> np.ndarray[Any, Any]:
    mixed = seeds.astype(np.int64)[:, None] * _MIX + np.arange(hidden, dtype=np.int64) * _COLUMN
    values: np.ndarray[Any, Any] = ((mixed // 128) % 17 - 8).astype(np.float64)
    return values


def _weights_numpy(hidden: int) -> np.ndarray[Any, Any]:
    k = np.arange(hidden, dtype=np.int64)[:, None]
    c = np.arange(hidden, dtype=np.int64)[None, :]
    weights: np.ndarray[Any, Any] = ((k * 31 + c * 17) % 3 - 1).astype(np.float64)
    return weights


class MatmulModel:
    """Static buffers for ``tokens`` rows of ``hidden`` values in ``dtype`` on ``device``."""

    def __init__(
        self,
        device: Any,
        *,
        tokens: int,
        hidden: int,
        dtype: Any = torch.bfloat16,
        graph: bool = False,
    ) -> None:
        if graph and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.device = device
        self.tokens = tokens
        self.hidden = hidden
        self.dtype = dtype
        self._weights64 = _weights_numpy(hidden)
        self.weights = torch.tensor(self._weights64, dtype=torch.float32, device=device)
        self._column_term = torch.arange(hidden, dtype=torch.int64, device=device) * _COLUMN
        self.seeds = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.x = torch.zeros((tokens, hidden), dtype=torch.float32, device=device)
        self._final32 = torch.zeros((tokens, hidden), dtype=torch.float32, device=device)
        #: The static outputs, by layer: what a step's hidden states are views of.
        self.outputs = {
            layer: torch.zeros((tokens, hidden), dtype=dtype, device=device)
            for layer in CAPTURED.layers
        }
        self.graph: Any = None
        if graph:
            self._capture()

    def _body(self) -> None:
        """What the graph holds: the layers from the static input, into the static outputs."""
        torch.mm(self.x, self.weights, out=self._final32)
        self.outputs[FINAL].copy_(self._final32)
        self.outputs[0].copy_(self.x)
        self.outputs[2].copy_(self.x * 3)

    def _capture(self) -> None:
        # As torch's documentation (and vLLM) do: warm up on a side stream (cuBLAS sets up its
        # handle and workspace there), then capture.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(3):
                self._body()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        torch.cuda.synchronize(self.device)

    def forward(self, seeds: Sequence[int]) -> int:
        """Compute a step of ``len(seeds)`` tokens into the static outputs, on the current
        stream, without waiting for the device; returns the token count."""
        count = len(seeds)
        if count > self.tokens:
            raise ValueError(f"{count} tokens in a step of at most {self.tokens}")
        padded = np.zeros(self.tokens, dtype=np.int64)
        padded[:count] = seeds
        staged = torch.from_numpy(padded)
        if self.device.type == "cuda":
            # As vLLM stages a step's inputs: pinned host memory, copied without the host
            # waiting for the stream (torch's host allocator keeps the block until the copy
            # is done).
            staged = staged.pin_memory()
        self.seeds.copy_(staged, non_blocking=True)
        mixed = self.seeds[:, None] * _MIX + self._column_term[None, :]
        self.x.copy_(torch.remainder(torch.div(mixed, 128, rounding_mode="floor"), 17) - 8)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        return count

    def layers(self, count: int) -> tuple[Any, list[Any]]:
        """The step's hidden states as vLLM V2 holds them: the final layer's, and the auxiliary
        layers' (``CAPTURED.aux_ids`` order), views of the first ``count`` static rows."""
        aux = [self.outputs[layer][:count] for layer in CAPTURED.aux_ids]
        return self.outputs[FINAL][:count], aux

    def reference(self, seeds: Sequence[int], layer: int) -> np.ndarray[Any, Any]:
        """``[len(seeds), hidden]`` float64: the rows of ``layer``, as held in ``dtype``."""
        x = _x_numpy(np.asarray(seeds, dtype=np.int64), self.hidden)
        if layer == 0:
            exact = x
        elif layer == 2:
            exact = 3 * x
        elif layer == FINAL:
            exact = x @ self._weights64
        else:
            raise KeyError(layer)
        held: np.ndarray[Any, Any] = (
            torch.from_numpy(exact).to(self.dtype).to(torch.float64).numpy()
        )
        return held
