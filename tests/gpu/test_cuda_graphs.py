"""Hidden states written by a replayed CUDA graph, and the stream order the hook relies on.

vLLM V2 replays a captured graph for a step (``ModelCudaGraphManager.run_fullgraph``) on the
current stream and hands out views of the graph's static ``hidden_states``; the next step copies
its inputs into the graph's static inputs and replays it again, writing the same buffer. The hook
copies step N's rows right after ``execute_model`` returns, on the current stream: behind replay
N, ahead of replay N + 1. So nothing waits, and yet the copy of step N is step N's.

- :func:`test_each_steps_copy_is_its_own_replays` -- the hook's own path, replay N + 1
  enqueued before the output that publishes step N, the device kept behind the host: every
  record is its step's (on CPU, the same steps with an eager forward into the same buffers);
- :func:`test_a_forward_on_a_side_stream_is_followed_by_the_copy` -- a runner that runs its
  forward on a stream of its own (``torch.cuda.stream``): the hook's copy goes to that stream;
- :func:`test_a_copy_on_another_stream_reads_the_next_replay` -- what the order is for: the
  same copy on another stream, started after replay N but not ordered before replay N + 1,
  reads step N + 1's states; with replay N + 1 made to wait for it (``wait_stream``), step
  N's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.batch import Engine, FakeV2Runner, NewRequest, Scheduled, Step
from tests.gpu.devices import DEVICES, device_of, needs_cuda, sleep_on_stream
from tests.gpu.model import CAPTURED, FINAL, MODEL, MatmulModel, seed_of
from tests.gpu.scenario import Ask, check_records, expected_records, key, ring
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.device_copy import AsyncRowCopier
from vllm_hidden_state_proxy.worker_hook.runners import V2RunnerView

STEPS = 24
REQUESTS = 8  # a step: 8 new requests whose whole prompts it computes
POOLINGS = ("last", "mean", "all_prompt", "last", "spans", "last", "mean", "last")


def sizes(device: Any) -> tuple[int, int]:
    """(tokens a step, hidden size): a real matmul on CUDA, a small one on CPU."""
    return (512, 1024) if device.type == "cuda" else (64, 64)


def graph_asks(tokens: int) -> list[list[Ask]]:
    """Each step's requests: ``REQUESTS`` prompts filling the step, every pooling but the
    answer's (their rows are kept, not read off the replay's buffer later)."""
    prompt = tokens // REQUESTS
    return [
        [
            Ask(
                f"s{step}-r{i}",
                prompt,
                POOLINGS[i],
                key(1 + step * REQUESTS + i),
                (0, 2, FINAL) if i % 2 else (FINAL,),
                spans=((1, prompt // 2), (0, prompt)) if POOLINGS[i] == "spans" else (),
            )
            for i in range(REQUESTS)
        ]
        for step in range(STEPS)
    ]


def as_steps(asks: list[list[Ask]]) -> list[Step]:
    steps = []
    for number, step_asks in enumerate(asks):
        batch = [Scheduled(a.name, a.prompt_len, 0, a.prompt_len, a.name) for a in step_asks]
        new = {a.name: NewRequest(a.extra_args(), a.max_tokens) for a in step_asks}
        finished = [a.name for a in asks[number - 1]] if number else []
        steps.append(Step(batch, new, finished))
    return steps


def run_replays(directory: Path, device: Any, *, graph: bool, stream: Any = None) -> Engine:
    tokens, hidden = sizes(device)
    asks = graph_asks(tokens)
    model = MatmulModel(device, tokens=tokens, hidden=hidden, dtype=torch.bfloat16, graph=graph)
    wanted = expected_records([a for step in asks for a in step], model)
    with ring(directory, hidden, slots=1024, arena_mib=64) as shared:
        capture = StepCapture(V2RunnerView(), shared.writer, MODEL, captured=CAPTURED)
        # As vLLM with async scheduling: replay N + 1 is enqueued before the output of step N
        # is collected (and its copies published); the device kept 10 ms a step behind.
        engine = Engine(FakeV2Runner(model), capture, lag=1, device_lag_us=10_000)
        if stream is None:
            engine.run(as_steps(asks))
        else:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                engine.run(as_steps(asks))
        got = shared.read_back(wanted)
        assert shared.writer.publish_count() == len(wanted)
    check_records(got, wanted, hidden)
    return engine


@pytest.mark.parametrize("device_name", DEVICES)
def test_each_steps_copy_is_its_own_replays(tmp_path: Path, device_name: str) -> None:
    device = device_of(device_name)
    engine = run_replays(tmp_path, device, graph=device.type == "cuda")
    if device.type == "cuda":
        assert isinstance(engine.capture.copier, AsyncRowCopier)
        # The copies were still in flight when later replays were enqueued.
        assert engine.collected_unpublished > 0


@needs_cuda
def test_a_forward_on_a_side_stream_is_followed_by_the_copy(tmp_path: Path) -> None:
    device = device_of("cuda")
    side = torch.cuda.Stream(device)
    engine = run_replays(tmp_path, device, graph=True, stream=side)
    assert engine.collected_unpublished > 0


def step_seeds(step: int, tokens: int) -> list[int]:
    return [seed_of(f"step{step}", position) for position in range(tokens)]


@needs_cuda
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "waited-for"])
def test_a_copy_on_another_stream_reads_the_next_replay(ordered: bool) -> None:
    device = device_of("cuda")
    tokens, hidden = sizes(device)
    model = MatmulModel(device, tokens=tokens, hidden=hidden, dtype=torch.bfloat16, graph=True)
    main = torch.cuda.current_stream(device)
    other = torch.cuda.Stream(device)
    copier = AsyncRowCopier()
    model.forward(step_seeds(0, tokens))  # replay N
    hidden_states, _ = model.layers(tokens)
    picked = [3, 0, tokens - 1]
    other.wait_stream(main)  # the copy starts after replay N ...
    with torch.cuda.stream(other):
        sleep_on_stream(device, 20_000)  # ... and, on its own stream, well after it
        vectors = copier.start([hidden_states[row] for row in picked])
        matrix = copier.start(hidden_states[: tokens // 2])
    if ordered:
        main.wait_stream(other)  # replay N + 1 waits for the copy: what one stream gives
    model.forward(step_seeds(1, tokens))  # replay N + 1, enqueued at once
    vectors.wait()
    matrix.wait()
    copied_rows = np.frombuffer(vectors.buffer(), "<f4").reshape(len(picked), hidden)
    copied_matrix = np.frombuffer(matrix.buffer(), "<f4").reshape(tokens // 2, hidden)
    step_n = model.reference(step_seeds(0, tokens), FINAL)
    step_n1 = model.reference(step_seeds(1, tokens), FINAL)
    assert not np.array_equal(step_n[picked], step_n1[picked])
    expected = step_n if ordered else step_n1
    np.testing.assert_array_equal(copied_rows, expected[picked])
    np.testing.assert_array_equal(copied_matrix, expected[: tokens // 2])
    vectors.release()
    matrix.release()
