"""The arena's reservation on real vLLM (issue #36, item 5): a matrix accepted when the hook
first sees its request is one that fits the arena until it is published.

Its own server, with an arena of 1 MiB that is also the max record, and the final layer only
(one row of the tiny model: 512 bytes): a matrix of exactly the max record (2048 rows) used to
be accepted and then fail to be written (its block's header did not fit: a 502 after vLLM's
work); four answers of a quarter of the arena each used to be accepted together, and the
fourth wrapped round and wrote the first over before the proxy read it (a 503 after the
work): now the fourth is refused when the hook first sees it. Runs in the own-server session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import RunningStack, run_serve
from tests.e2e.test_matrices import decode
from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV, MAX_RECORD_MIB_ENV
from vllm_hidden_state_proxy.tiny_model import HIDDEN_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]

#: One position's row of the final layer, and the rows of exactly the max record (1 MiB).
ROW = 4 * HIDDEN_SIZE
MAX_ROWS = (1 << 20) // ROW
#: An answer of a quarter of the arena: 256 KiB of rows (and its block's header).
QUARTER = MAX_ROWS // 4


@pytest.fixture(scope="module")
def arena_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    args = [
        "--hidden-state-layers",
        "-1",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "4096",
    ]
    env = {ARENA_MIB_ENV: "1", MAX_RECORD_MIB_ENV: "1"}
    with run_serve(tiny_model_dir, tmp_path_factory.mktemp("arena"), args, env) as stack:
        yield stack


@pytest.fixture()
def arena_client(arena_stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=arena_stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )


def kv(pooling: str) -> dict[str, Any]:
    return {
        "return_last_hidden_state": True,
        "last_hidden_state_pooling": pooling,
        "last_hidden_state_info": True,
    }


def prompt_of(reference: Reference, count: int) -> list[int]:
    """``count`` token ids of ordinary text."""
    ids: list[int] = reference.tokenizer.encode("a lantern in the harbour " * count)
    return ids[:count]


def all_prompt(client: openai.OpenAI, model: str, ids: list[int]) -> dict[str, Any]:
    answer: dict[str, Any] = client.completions.create(
        model=model, prompt=ids, max_tokens=1, extra_body={"kv_transfer_params": kv("all_prompt")}
    ).model_dump()
    return answer


def test_a_matrix_of_exactly_the_max_record_is_a_413_and_one_row_less_fits(
    arena_client: openai.OpenAI, model_name: str, reference: Reference
) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        all_prompt(arena_client, model_name, prompt_of(reference, MAX_ROWS))
    assert raised.value.status_code == 413, raised.value.message
    assert MAX_RECORD_MIB_ENV in raised.value.message and "header" in raised.value.message
    ids = prompt_of(reference, MAX_ROWS - 1)  # 64 bytes short of the max record: it fits
    answer = all_prompt(arena_client, model_name, ids)
    params = answer["kv_transfer_params"]
    assert params["last_hidden_state_info"]["rows"] == len(ids)
    rows = decode(params["last_hidden_state"], reference.hidden_size)
    expected = reference.layer_rows(ids, -1)
    assert len(rows) == len(expected)
    for row, want in zip(rows[:: len(rows) // 16], expected[:: len(rows) // 16], strict=True):
        assert_matches(row.tolist(), want, "layer -1, all_prompt")


def answers(client: openai.OpenAI, model: str, n: int) -> dict[str, Any]:
    """One chat of ``n`` choices of a quarter of the arena each (``QUARTER`` tokens)."""
    answer: dict[str, Any] = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"{n} quarters: describe a harbour."}],
        max_completion_tokens=QUARTER,
        n=n,
        temperature=1.0,
        seed=n,
        extra_body={
            **NO_THINKING,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": kv("all_answer"),
        },
    ).model_dump()
    return answer


def test_answers_that_would_wrap_the_arena_are_refused_at_reservation_never_written_over(
    arena_client: openai.OpenAI, model_name: str, reference: Reference
) -> None:
    """Four answers of a quarter of the arena each, decoding together, do not fit with their
    blocks' headers: the one the hook sees last is refused when it is first seen (a 503 naming
    the arena, never "written over" after the work). Three fit, and are whole.

    The four are the choices of one request (n = 4): vLLM adds its children together, so the
    hook sees all four long before any of their 512 tokens is chosen, whatever the machine's
    load (four requests sent together overlapped in every run but one on a loaded machine)."""
    with pytest.raises(openai.APIStatusError) as raised:
        answers(arena_client, model_name, 4)
    assert raised.value.status_code == 503, raised.value.message
    assert "being gathered" in raised.value.message, raised.value.message
    assert ARENA_MIB_ENV in raised.value.message
    result = answers(arena_client, model_name, 3)
    params = result["kv_transfer_params"]
    prompt_ids = result["prompt_token_ids"]
    per_choice = zip(
        result["choices"],
        params["last_hidden_states"],
        params["last_hidden_state_infos"],
        strict=True,
    )
    for choice, matrix, info in per_choice:
        answer_ids = choice["token_ids"]
        assert info["rows"] == len(answer_ids) == QUARTER
        rows = decode(matrix, reference.hidden_size)
        expected = reference.layer_rows([*prompt_ids, *answer_ids[:-1]], -1)[len(prompt_ids) - 1 :]
        assert len(rows) == len(expected)
        for row, want in zip(rows[::32], expected[::32], strict=True):
            assert_matches(row.tolist(), want, "layer -1, all_answer")
