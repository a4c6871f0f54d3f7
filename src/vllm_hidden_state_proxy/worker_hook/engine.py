"""Which engine a worker belongs to, and whether it is the worker that publishes.

Read from vLLM's own config objects only (no distributed state), so the rules are unit-tested
on real ``VllmConfig``/``ParallelConfig`` objects.

- **The engine** is ``parallel_config.data_parallel_index``: vLLM keeps the engine's real
  data-parallel rank there. ``data_parallel_rank`` is not it: for dense (non-MoE) models vLLM
  runs each data-parallel engine as an independent DP=1 engine and resets that rank to 0 in
  every engine core (``vllm/v1/engine/core.py``).
- **The instance** tells the engines of one vLLM server from those of another that shares the
  ring directory: a 64-bit digest of ``vllm_config.instance_id``, which the server's front end
  sets once and hands to every engine it starts.
- **The publishing worker** is tensor-parallel rank 0 of the last pipeline stage: the one whose
  step state holds the final hidden states of the whole batch, and whose output is the one the
  engine forwards. vLLM orders a DP group's ranks as PP x PCP x TP, so ``rank % TP`` is the
  tensor-parallel rank and ``rank // (TP * PCP) % PP`` the pipeline stage.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    instance: int
    engine: int


def _size(parallel_config: Any, name: str) -> int:
    return int(getattr(parallel_config, name, 1) or 1)


def is_publishing_rank(parallel_config: Any) -> bool:
    """Whether this worker is tensor-parallel rank 0 of the last pipeline stage."""
    tp = _size(parallel_config, "tensor_parallel_size")
    pp = _size(parallel_config, "pipeline_parallel_size")
    pcp = _size(parallel_config, "prefill_context_parallel_size")
    rank = int(getattr(parallel_config, "rank", 0) or 0)
    return rank % tp == 0 and (rank // (tp * pcp)) % pp == pp - 1


def instance_of(vllm_config: Any) -> int:
    """A 64-bit number shared by the engines of one vLLM server (random if vLLM has none)."""
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    if not instance_id:
        return secrets.randbits(64)
    return int.from_bytes(hashlib.blake2b(instance_id.encode(), digest_size=8).digest(), "big")


def engine_identity(vllm_config: Any) -> EngineIdentity:
    parallel_config = vllm_config.parallel_config
    engine = getattr(parallel_config, "data_parallel_index", None)
    if engine is None:  # before vLLM set it (it is not an init field)
        engine = getattr(parallel_config, "data_parallel_rank", 0)
    return EngineIdentity(instance=instance_of(vllm_config), engine=int(engine or 0))
