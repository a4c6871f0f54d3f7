"""engine.py on vLLM's own config objects: which ring an engine gets, and which worker publishes.

``ParallelConfig`` and ``VllmConfig`` are built without starting vLLM, and changed the way
vLLM changes them: an engine core process gets its own (pickled) copy of the front end's
``VllmConfig`` and sets ``data_parallel_index`` and, for a dense model,
``reconfigure_for_independent_dp_rank()`` (``run_engine_core`` in ``vllm/v1/engine/core.py``);
each worker sets ``parallel_config.rank`` (``WorkerBase.__init__``).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import ParallelConfig, VllmConfig

from tests.worker_hook.fakes import (
    FINAL,
    FakeModelConfig,
    FakeV1Runner,
    key,
    record_of,
    row_vector,
    step,
)
from vllm_hidden_state_proxy.ring import RingDirectory
from vllm_hidden_state_proxy.ring.files import ring_name
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.engine import (
    EngineIdentity,
    engine_identity,
    instance_of,
    is_publishing_rank,
)
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView

# -- the publishing worker ------------------------------------------------------------------------


def vllm_output_rank(parallel_config: Any) -> int:
    """The rank whose output vLLM's multiprocessing executor forwards (vLLM's own code)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executor = SimpleNamespace(
        world_size=parallel_config.world_size, parallel_config=parallel_config
    )
    rank: int = MultiprocExecutor._get_output_rank(executor)
    return rank


def rank_layout(parallel_config: Any) -> torch.Tensor:
    """vLLM's rank order within a data-parallel group: ``[pp, pcp, tp]``
    (``initialize_model_parallel`` in ``vllm/distributed/parallel_state.py``)."""
    return torch.arange(parallel_config.world_size).reshape(
        parallel_config.pipeline_parallel_size,
        parallel_config.prefill_context_parallel_size,
        parallel_config.tensor_parallel_size,
    )


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2), (4, 1), (1, 3), (2, 3)])
def test_only_tensor_parallel_rank_0_of_the_last_stage_publishes(tp: int, pp: int) -> None:
    parallel_config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert parallel_config.world_size == tp * pp
    publishing = []
    for rank in range(parallel_config.world_size):
        parallel_config.rank = rank  # as each worker does
        if is_publishing_rank(parallel_config):
            publishing.append(rank)
    last_stage_tp0 = int(rank_layout(parallel_config)[pp - 1, 0, 0])
    assert publishing == [last_stage_tp0] == [(pp - 1) * tp]
    assert publishing == [vllm_output_rank(parallel_config)]


def test_with_context_parallelism_vllms_output_rank_is_among_the_publishing_ones() -> None:
    """The capture refuses prefill context parallelism (test_capture); the rank rule still
    reads the stage right with PCP between PP and TP."""
    parallel_config = ParallelConfig(
        tensor_parallel_size=2, pipeline_parallel_size=2, prefill_context_parallel_size=2
    )
    layout = rank_layout(parallel_config)
    publishing = []
    for rank in range(parallel_config.world_size):
        parallel_config.rank = rank
        if is_publishing_rank(parallel_config):
            publishing.append(rank)
    assert publishing == [int(layout[1, 0, 0]), int(layout[1, 1, 0])]
    assert vllm_output_rank(parallel_config) in publishing


@pytest.fixture
def tp2_pp2_config() -> VllmConfig:
    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    )
    config.model_config = FakeModelConfig()
    return config


def test_a_non_publishing_worker_never_touches_the_ring(
    tp2_pp2_config: VllmConfig, ring_env: Path
) -> None:
    made = []
    try:
        for rank in range(4):  # stage 0: ranks 0, 1; the last stage: ranks 2 (TP 0), 3
            worker_config = copy.deepcopy(tp2_pp2_config)  # each worker process has its own
            worker_config.parallel_config.rank = rank
            runner = FakeV1Runner(vllm_config=worker_config)
            before = sorted(ring_env.iterdir()) if ring_env.exists() else None
            capture = StepCapture.for_runner(runner, V1RunnerView())
            made.append(capture)
            # A flagged request whose whole prompt is in this step.
            step(capture, runner, [("a", 3, 0, 3)], new={"a": key(rank + 1)})
            capture.after_sample_tokens(object())
            after = sorted(ring_env.iterdir()) if ring_env.exists() else None
            assert capture.publishing is (rank == 2), rank
            if rank != 2:
                assert after == before, f"rank {rank} changed the ring directory"
                assert capture.selected.pending == {}
        assert len(list(ring_env.glob("*.bin"))) == 1
        with RingDirectory(ring_env) as directory:
            assert directory.live_ring_count() == 1
            assert record_of(directory.lookup(key(3))).vector(FINAL) == row_vector(2)
            for rank in (0, 1, 3):
                assert directory.lookup(key(rank + 1)) is None
    finally:
        for capture in made:
            if capture.writer is not None:
                capture.writer.close()


# -- the engine and the instance ------------------------------------------------------------------


def engine_core_config(front_end: VllmConfig, dp_rank: int, *, moe: bool = False) -> VllmConfig:
    """The config an engine core process works with: its own copy of the front end's, adjusted
    as ``run_engine_core`` does for a dense (or MoE) model."""
    config: VllmConfig = pickle.loads(pickle.dumps(front_end))
    parallel_config = config.parallel_config
    parallel_config.data_parallel_index = dp_rank
    if moe:
        parallel_config.data_parallel_rank = dp_rank
    else:
        # Non-MoE DP ranks are completely independent, so treat like DP=1.
        parallel_config.reconfigure_for_independent_dp_rank()
    return config


@pytest.fixture(scope="module")
def dp4_front_end() -> VllmConfig:
    return VllmConfig(parallel_config=ParallelConfig(data_parallel_size=4))


def test_dense_dp_engines_never_share_a_ring_name(dp4_front_end: VllmConfig) -> None:
    engines = [engine_core_config(dp4_front_end, dp_rank) for dp_rank in range(4)]
    # What the hook used to name rings after: vLLM resets it in every dense engine.
    assert [e.parallel_config.data_parallel_rank for e in engines] == [0, 0, 0, 0]
    assert [e.parallel_config.data_parallel_size for e in engines] == [1, 1, 1, 1]
    identities = [engine_identity(e) for e in engines]
    instance = instance_of(dp4_front_end)
    assert identities == [EngineIdentity(instance, engine) for engine in range(4)]
    names = {ring_name(i.instance, i.engine) for i in identities}
    assert len(names) == 4


def test_dp_across_nodes_names_rings_by_the_global_index() -> None:
    """``--data-parallel-size 4 --data-parallel-size-local 2``: the second node's front end
    (start rank 2) launches engines 2 and 3 (vLLM's ``CoreEngineProcManager``: ``dp_rank`` is
    the start rank plus the local index), so each node's rings, and both nodes' together, are
    distinct."""
    nodes = [
        VllmConfig(
            parallel_config=ParallelConfig(
                data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank=start
            )
        )
        for start in (0, 2)
    ]
    identities = [
        engine_identity(engine_core_config(node, start + local))
        for node, start in zip(nodes, (0, 2), strict=True)
        for local in range(2)
    ]
    assert [identity.engine for identity in identities] == [0, 1, 2, 3]
    assert len({ring_name(i.instance, i.engine) for i in identities}) == 4


def test_moe_dp_engines_never_share_a_ring_name(dp4_front_end: VllmConfig) -> None:
    engines = [engine_core_config(dp4_front_end, dp_rank, moe=True) for dp_rank in range(4)]
    assert [engine_identity(e).engine for e in engines] == [0, 1, 2, 3]


def test_every_worker_of_an_engine_names_the_same_ring(dp4_front_end: VllmConfig) -> None:
    engine = engine_core_config(dp4_front_end, 2)
    workers = [copy.deepcopy(engine) for _ in range(2)]
    for rank, worker in enumerate(workers):
        worker.parallel_config.rank = rank
    assert {engine_identity(w) for w in workers} == {EngineIdentity(instance_of(engine), 2)}


def test_two_servers_get_different_instances() -> None:
    first, second = VllmConfig(), VllmConfig()
    assert first.instance_id != second.instance_id  # vLLM sets one per VllmConfig it builds
    assert engine_identity(first).engine == engine_identity(second).engine == 0
    assert instance_of(first) != instance_of(second)


def test_instance_of_is_a_digest_of_vllms_instance_id() -> None:
    assert instance_of(SimpleNamespace(instance_id="abc")) == instance_of(
        SimpleNamespace(instance_id="abc")
    )
    assert instance_of(SimpleNamespace(instance_id="abc")) != instance_of(
        SimpleNamespace(instance_id="abd")
    )
    assert 0 <= instance_of(SimpleNamespace(instance_id="abc")) < 1 << 64
    # Without one (an older vLLM), each engine gets a random instance.
    assert instance_of(SimpleNamespace()) != instance_of(SimpleNamespace(instance_id=""))


def test_the_engine_falls_back_to_data_parallel_rank_before_vllm_sets_the_index() -> None:
    config = SimpleNamespace(instance_id="x", parallel_config=SimpleNamespace(data_parallel_rank=5))
    assert engine_identity(config).engine == 5
    config.parallel_config.data_parallel_index = 3
    assert engine_identity(config).engine == 3


def writer_of(capture: StepCapture) -> Any:
    assert capture.writer is not None, "no ring"
    return capture.writer


@pytest.fixture
def started() -> Iterator[list[StepCapture]]:
    made: list[StepCapture] = []
    yield made
    for capture in made:
        if capture.writer is not None:
            capture.writer.close()


def start_engine(config: VllmConfig, started: list[StepCapture]) -> tuple[Any, StepCapture]:
    config.model_config = FakeModelConfig()
    runner = FakeV1Runner(vllm_config=config)
    capture = StepCapture.for_runner(runner, V1RunnerView())
    started.append(capture)
    return runner, capture


def test_dense_dp_engines_each_publish_into_their_own_ring(
    dp4_front_end: VllmConfig, ring_env: Path, started: list[StepCapture]
) -> None:
    """Two engine cores of one server, in one ring directory: both rings live, every key found."""
    engines = [start_engine(engine_core_config(dp4_front_end, r), started) for r in (0, 1)]
    paths = {writer_of(capture).path for _, capture in engines}
    assert len(paths) == 2
    for number, (runner, capture) in enumerate(engines):
        step(capture, runner, [("same-req-id", 2, 0, 2)], new={"same-req-id": key(number + 1)})
    with RingDirectory(ring_env) as directory:
        assert directory.live_ring_count() == 2
        assert directory.failed_engines() == ()
        assert directory.publishing_instances() == {instance_of(dp4_front_end)}
        for number in (0, 1):
            assert record_of(directory.lookup(key(number + 1))).vector(FINAL) == row_vector(1)


def test_two_servers_sharing_a_ring_directory_each_get_their_rings(
    ring_env: Path, started: list[StepCapture]
) -> None:
    servers = [VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2)) for _ in "ab"]
    for server in servers:
        for dp_rank in (0, 1):
            start_engine(engine_core_config(server, dp_rank), started)
    assert len({writer_of(capture).path for capture in started}) == 4
    with RingDirectory(ring_env) as directory:
        assert directory.live_ring_count() == 4
        assert directory.publishing_instances() == {instance_of(s) for s in servers}
