"""The offline API's loop against a real ring and a fake engine (no model): results in input
order, never more requests in flight than the ring's slots hold, every vector its own prompt's;
a record written over, missing, of another shape, or the hook's error: an error naming the
prompt; no ring: the server's 503 in its words. (On real vLLM: tests/e2e/test_offline.py; the
vLLM classes it drives, on 0.32 and 0.34: tests/worker_hook/test_offline_vllm.py.)"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_hidden_state_proxy import offline
from vllm_hidden_state_proxy.client import HiddenStateRequestError
from vllm_hidden_state_proxy.protocol import (
    HOOK_ENABLED_ENV,
    REQUEST_KEY_ENTRY,
    RING_DIR_ENV,
    request_key_from_wire,
)
from vllm_hidden_state_proxy.ring import FailureNote, RingWriter
from vllm_hidden_state_proxy.worker_hook.engine import engine_identity

HIDDEN = 8
LAYERS = 2  # the final layer's index
SLOTS = 8


def _vllm_config() -> Any:
    return SimpleNamespace(
        instance_id="offline-test",
        parallel_config=SimpleNamespace(data_parallel_index=0),
        model_config=SimpleNamespace(max_model_len=64, get_hidden_size=lambda: HIDDEN),
    )


class FakeEngine:
    """``LLMEngine``'s loop over a real ring: each step computes every request added since the
    last one (publishing its record as the hook does, a vector of its first token id, or what
    ``forge`` makes of it) and finishes ``per_step`` requests, the newest first."""

    def __init__(self, writer: RingWriter, per_step: int = 3, newest_first: bool = True) -> None:
        self.writer = writer
        self.vllm_config = _vllm_config()
        self.engine_core = object()
        self.per_step = per_step
        self.newest_first = newest_first
        self.added: list[tuple[str, dict[str, Any], Any]] = []
        self.computed: list[tuple[str, dict[str, Any], Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.aborted: list[str] = []
        self.flood = 0
        self.forge: Any = None

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any, **_: Any) -> str:
        self.added.append((request_id, prompt, params))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return f"{request_id}-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.added or self.computed)

    def step(self) -> list[Any]:
        for _, prompt, params in self.added:
            key = request_key_from_wire(params.extra_args[REQUEST_KEY_ENTRY])
            assert key is not None
            ids = prompt["prompt_token_ids"]
            if self.forge is not None and self.forge(self.writer, key, ids):
                continue
            vector = np.full(HIDDEN, ids[0], dtype="<f4").tobytes()
            self.writer.publish(key, vector, position=len(ids) - 1, num_prompt_tokens=len(ids))
        for i in range(self.flood):  # records of other requests, as a busy engine's
            self.writer.publish_error(os.urandom(16), f"another request {i}")
        self.computed += self.added
        self.added = []
        if self.newest_first:
            done, self.computed = self.computed[-self.per_step :], self.computed[: -self.per_step]
        else:
            done, self.computed = self.computed[: self.per_step], self.computed[self.per_step :]
        self.in_flight -= len(done)
        return [
            SimpleNamespace(
                request_id=request_id,
                finished=True,
                prompt_token_ids=prompt["prompt_token_ids"],
                outputs=[SimpleNamespace(index=0, token_ids=[1], text="")],
            )
            for request_id, prompt, _ in (reversed(done) if self.newest_first else done)
        ]

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.aborted += request_ids
        self.added, self.computed = [], []


def _tokens(prompt: Any) -> dict[str, Any]:
    """A prompt's "tokens": its number first (the fake engine's vector), then one per word."""
    number, _, text = str(prompt).partition(":")
    return {"type": "token", "prompt_token_ids": [int(number), *range(len(text.split()))]}


@pytest.fixture
def writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RingWriter]:
    monkeypatch.setenv(RING_DIR_ENV, str(tmp_path / "rings"))
    identity = engine_identity(_vllm_config())
    with RingWriter.create(
        tmp_path / "rings",
        hidden_size=HIDDEN,
        model="test",
        slot_count=SLOTS,
        instance=identity.instance,
        num_hidden_layers=LAYERS,
    ) as ring:
        yield ring


@pytest.fixture
def llm(writer: RingWriter) -> Any:
    from vllm import SamplingParams

    return SimpleNamespace(
        llm_engine=FakeEngine(writer),
        request_counter=itertools.count(),
        _preprocess_cmpl_one=lambda prompt, *_, **__: _tokens(prompt),
        _preprocess_chat_one=lambda conversation, **_: _tokens(conversation[-1]["content"]),
        get_default_sampling_params=lambda: SamplingParams(max_tokens=1),
    )


def test_results_in_input_order_never_more_than_the_ring_holds(llm: Any) -> None:
    prompts = [f"{i}: words of prompt {i}" for i in range(200)]
    results = offline.generate(llm, prompts, use_tqdm=False)
    assert [int(output.request_id) for output, _ in results] == list(range(200))
    for i, (_, states) in enumerate(results):
        assert states.vector is not None and set(states.vector.tolist()) == {float(i)}
        assert states.info is not None and states.info["num_prompt_tokens"] == 5
    assert llm.llm_engine.most_in_flight == SLOTS  # a window of the ring's slots, full


def test_chats_and_lazy_inputs(llm: Any) -> None:
    conversations = ([{"role": "user", "content": f"{i}: hello"}] for i in range(20))
    results = list(offline.iter_chat(llm, conversations, use_tqdm=False))
    assert [states.single.layer(-1)[0] for _, states in results] == [float(i) for i in range(20)]


def test_a_record_written_over_names_its_prompt(llm: Any) -> None:
    llm.llm_engine.flood = SLOTS  # another writer's worth of records between two reads
    with pytest.raises(offline.OfflineHiddenStateError) as over:
        offline.generate(llm, [f"{i}: x" for i in range(20)], use_tqdm=False)
    assert over.value.status == 504 and over.value.index is not None
    assert f"prompt {over.value.index} ('{over.value.index}: x')" in str(over.value)
    assert "written over" in str(over.value)


def test_the_hooks_error_record_is_the_prompts_error(llm: Any) -> None:
    def forge(writer: RingWriter, key: bytes, ids: list[int]) -> bool:
        if ids[0] != 1:
            return False
        writer.publish_error(key, "a span ends past the prompt", 400)
        return True

    llm.llm_engine.forge = forge
    llm.llm_engine.newest_first = False
    with pytest.raises(offline.OfflineHiddenStateError) as failed:
        offline.generate(llm, [f"{i}: x" for i in range(20)], use_tqdm=False)
    assert failed.value.status == 400 and failed.value.index == 1
    assert "prompt 1 ('1: x'): a span ends past the prompt" in str(failed.value)
    assert llm.llm_engine.aborted  # the requests still in flight do not stay in the engine


@pytest.mark.parametrize(
    ("position", "num_prompt_tokens", "pooling"),
    [(0, 3, "last"), (3, 4, "last"), (2, 3, "mean")],
    ids=["position", "prompt length", "pooling"],
)
def test_a_record_of_another_shape_is_never_a_vector(
    llm: Any, position: int, num_prompt_tokens: int, pooling: str
) -> None:
    """The prompt "7: a b" has 3 tokens: its record is of position 2, pooling "last"."""

    def forge(writer: RingWriter, key: bytes, ids: list[int]) -> bool:
        writer.publish(
            key, bytes(4 * HIDDEN), position=position, num_prompt_tokens=num_prompt_tokens,
            pooling=pooling,
        )  # fmt: skip
        return True

    llm.llm_engine.forge = forge
    with pytest.raises(offline.OfflineHiddenStateError) as refused:
        offline.generate(llm, ["7: a b"], use_tqdm=False)
    assert refused.value.status == 502 and refused.value.index == 0
    assert "prompt 0 ('7: a b')" in str(refused.value)


def test_a_missing_record_is_a_timeout_naming_the_prompt(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm.llm_engine.forge = lambda writer, key, ids: True  # published nothing
    monkeypatch.setattr("vllm_hidden_state_proxy.offline.records.RECORD_TIMEOUT", 0.2)
    with pytest.raises(offline.OfflineHiddenStateError) as missing:
        offline.generate(llm, ["5: a"], use_tqdm=False)
    assert missing.value.status == 504 and "did not arrive" in str(missing.value)


def test_a_caller_that_stops_early_leaves_no_request_behind(llm: Any) -> None:
    llm.llm_engine.newest_first = False
    results = offline.iter_generate(llm, [f"{i}: x" for i in range(50)], use_tqdm=False)
    first = next(results)
    assert first.states.vector is not None
    results.close()
    assert llm.llm_engine.aborted and not llm.llm_engine.has_unfinished_requests()


def test_options_checked_by_the_servers_rules_named_as_arguments(llm: Any) -> None:
    with pytest.raises(HiddenStateRequestError) as refused:
        offline.generate(llm, ["1: x"], pooling="max")  # type: ignore[arg-type]
    assert refused.value.param == "pooling" and "'pooling' must be one of" in str(refused.value)
    with pytest.raises(HiddenStateRequestError, match="not captured") as layer:
        offline.generate(llm, ["1: x"], layers=[1])
    assert layer.value.param == "layers"


def test_no_ring_is_the_servers_503(llm: Any, writer: RingWriter) -> None:
    writer.close()
    with pytest.raises(offline.OfflineHiddenStateError) as inactive:
        offline.generate(llm, ["1: x"])
    assert inactive.value.status == 503
    assert "worker hook is not active in this LLM's engine" in str(inactive.value)


def test_the_hook_switched_off_is_named(
    llm: Any, writer: RingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer.close()
    monkeypatch.setenv(HOOK_ENABLED_ENV, "0")
    with pytest.raises(offline.OfflineHiddenStateError, match=f"{HOOK_ENABLED_ENV}=0"):
        offline.generate(llm, ["1: x"])


def test_the_engines_failure_note_is_the_error(llm: Any, writer: RingWriter) -> None:
    writer.close()
    identity = engine_identity(llm.llm_engine.vllm_config)
    note = FailureNote.write(
        os.environ[RING_DIR_ENV],
        instance=identity.instance,
        engine=identity.engine,
        message="UnsupportedRunner: vLLM 0.99.0 lacks ExecuteModelState.hidden_states",
        fatal=True,
    )
    try:
        with pytest.raises(offline.OfflineHiddenStateError) as noted:
            offline.generate(llm, ["1: x"])
    finally:
        note.close()
    assert noted.value.status == 503
    assert "vLLM 0.99.0 lacks ExecuteModelState.hidden_states" in str(noted.value)


def test_a_vllm_without_what_the_calls_drive(llm: Any) -> None:
    del llm._preprocess_cmpl_one
    with pytest.raises(offline.OfflineHiddenStateError, match=r"lacks LLM._preprocess_cmpl_one"):
        offline.generate(llm, ["1: x"])
