"""The vLLM classes the offline API drives (``vllm_hidden_state_proxy/offline``), read on this
venv's vLLM: 0.32 (CPU) in the dev venv, 0.34's GPU wheel in ``make test-vllm-next``. What it
calls must be there, with the arguments it passes; what it reads of the outputs, named so."""

from __future__ import annotations

import copy
import inspect
from typing import Any

from vllm_hidden_state_proxy.offline.engine_ring import ENGINE_METHODS, LLM_METHODS
from vllm_hidden_state_proxy.protocol import (
    CHOICES_ENTRY,
    REQUEST_KEY_ENTRY,
    new_request_key,
    request_key_to_wire,
)
from vllm_hidden_state_proxy.request_fields import VectorRequest
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, xargs_entries


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_llm_renders_prompts_as_generate_and_chat_do() -> None:
    from vllm import LLM

    for name in LLM_METHODS:
        assert callable(getattr(LLM, name, None)), name
    completion = _parameters(LLM._preprocess_cmpl_one)
    assert completion[1:3] == ["prompt", "tokenization_kwargs"]
    assert "mm_processor_kwargs" in completion
    assert {
        "chat_template",
        "chat_template_content_format",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "tokenization_kwargs",
        "mm_processor_kwargs",
    } <= set(_parameters(LLM._preprocess_chat_one))
    assert "self.request_counter = Counter()" in inspect.getsource(LLM.__init__)


def test_the_engine_loop_takes_what_it_is_given() -> None:
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    for name in ENGINE_METHODS:
        assert callable(getattr(LLMEngine, name, None)), name
    add = _parameters(LLMEngine.add_request)
    assert add[1:4] == ["request_id", "prompt", "params"]
    assert {"lora_request", "priority"} <= set(add)
    assert _parameters(LLMEngine.abort_request)[1:3] == ["request_ids", "internal"]
    assert callable(InprocClient.get_output)  # in-process engines: one more step publishes


def test_sampling_params_carry_the_request_key_in_a_copy() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    theirs = SamplingParams(max_tokens=3, n=2, temperature=1.0, stop=["x"], extra_args={"mine": 1})
    ours = copy.copy(theirs)  # as engine_loop copies it
    wanted = WantedVectors(VectorRequest(pooling="last_answer"), (2,), 2)
    wire = request_key_to_wire(new_request_key())
    ours.extra_args = {**(ours.extra_args or {}), **xargs_entries(wire, wanted), CHOICES_ENTRY: 2}
    ours.output_kind = RequestOutputKind.FINAL_ONLY
    assert theirs.extra_args == {"mine": 1} and theirs.output_kind != ours.output_kind
    assert ours.n == 2 and ours.max_tokens == 3 and ours.stop == ["x"]
    # vLLM's own checks of extra_args (they travel to the engine as msgpack) take them.
    SamplingParams(max_tokens=3, extra_args=ours.extra_args)
    assert ours.extra_args[REQUEST_KEY_ENTRY] == wire
    assert SamplingParams(max_tokens=1, detokenize=False).detokenize is False


def test_outputs_say_what_records_are_checked_against() -> None:
    from vllm.outputs import CompletionOutput, RequestOutput

    assert {"request_id", "prompt_token_ids", "outputs", "finished", "num_cached_tokens"} <= set(
        _parameters(RequestOutput.__init__)
    )
    assert {"index", "token_ids"} <= set(_parameters(CompletionOutput))


def test_a_rendered_prompt_carries_its_tokens_and_a_cache_salt() -> None:
    from vllm.inputs.engine import tokens_input

    assert tokens_input([5, 6], cache_salt="salt") == {
        "type": "token",
        "prompt_token_ids": [5, 6],
        "cache_salt": "salt",
    }
