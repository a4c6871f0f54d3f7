"""Tensor parallel 2 on CPU: one vector per request, published by rank 0 only.

Runs in its own pytest session (``make test`` runs ``-m own_server`` after the rest), since
only one vLLM server may run at a time here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import RunningStack, run_serve

pytestmark = pytest.mark.own_server


@pytest.fixture(scope="module")
def tp_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    with run_serve(
        tiny_model_dir,
        tmp_path_factory.mktemp("serve-tp2"),
        extra_args=["--tensor-parallel-size", "2", "--hidden-state-layers", "0,1,-1"],
        # vLLM CPU refuses TP on one NUMA node unless each rank gets its own cores.
        env_overrides={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ) as running:
        yield running


def test_tp2_vectors_match_transformers_and_only_rank_zero_publishes(
    tp_stack: RunningStack, model_name: str, reference: Reference
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=tp_stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    for text in ["Tensor parallel one.", "Tensor parallel two, a longer prompt about rivers."]:
        messages: Any = [{"role": "user", "content": text}]
        response = client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=2,
            extra_body={
                "chat_template_kwargs": {"enable_thinking": False},
                "kv_transfer_params": {"return_last_hidden_state": True},
            },
        )
        vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
        ids = reference.chat_token_ids(messages, enable_thinking=False)
        assert_matches(vector, reference.last_hidden_state(ids))
    ring_files = sorted(p.name for p in tp_stack.ring_dir.iterdir())
    assert len(ring_files) == 1 and ring_files[0].endswith("-dp0.bin"), ring_files
    log = tp_stack.log_path.read_text(errors="replace")
    assert log.count("worker hook active") == 1, "exactly one rank publishes"


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_tp2_layers_and_pooling_match_transformers(
    tp_stack: RunningStack, model_name: str, reference: Reference, pooling: str
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=tp_stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Tensor parallel layers: " + "a harbour at dusk " * 12}
    ]
    response = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=1,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "kv_transfer_params": {
                "return_last_hidden_state": True,
                "last_hidden_state_layers": [0, 1, -1],
                "last_hidden_state_pooling": pooling,
            },
        },
    )
    by_layer = response.model_dump()["kv_transfer_params"]["last_hidden_states_by_layer"]
    ids = reference.chat_token_ids(messages, enable_thinking=False)
    for label, vector in by_layer.items():
        assert_matches(
            vector,
            reference.layer_vector(ids, int(label), pooling),
            f"layer {label}, {pooling}",
        )
