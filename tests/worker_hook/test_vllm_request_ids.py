"""A list's engine request ids as the installed vLLM itself forms them, parsed back by the hook.

The hook attributes each prompt of a list sent as one request by parsing its engine id
(``selection.prompt_index``). These tests form the ids with vLLM's own code wherever it is a
function (the random suffix: ``InputProcessor.assign_request_id``; the ``n > 1`` children:
``ParentRequest.get_child_info``) and check the serving code's f-strings in its source where it
is not (the ``cmpl-``/``chatcmpl-`` base and the item separator): run on vLLM 0.32 here and on
0.34's wheel by ``make test-vllm-next``, they fail when a vLLM names its requests otherwise,
before any vector could go to the wrong prompt.
"""

from __future__ import annotations

import importlib
import inspect
import secrets
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_hidden_state_proxy.worker_hook.selection import PromptList, prompt_index

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest

#: Where each route's serving code forms its item ids, and the f-strings it must use.
SERVING = {
    "cmpl": (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion",
        ('f"cmpl-{self._base_request_id(raw_request, request.request_id)}"', 'f"{request_id}-{i}"'),
    ),
    "chatcmpl": (
        "vllm.entrypoints.openai.chat_completion.batch_serving",
        None,
        (
            'f"chatcmpl-{self._base_request_id(raw_request, request.request_id)}"',
            'f"{request_id}_{i}"',
        ),
    ),
}


def serving_source(form: str) -> str:
    module_name, class_name, _ = SERVING[form]
    module = importlib.import_module(module_name)
    return inspect.getsource(getattr(module, class_name) if class_name else module)


@pytest.mark.parametrize("form", sorted(SERVING))
def test_the_serving_code_forms_item_ids_as_the_hook_parses_them(form: str) -> None:
    source = " ".join(serving_source(form).split())
    for expected in SERVING[form][2]:
        assert expected in source, f"vLLM's {form} serving code no longer uses {expected}"


def test_the_header_names_the_base() -> None:
    """The proxy's ``X-Request-Id`` is the base vLLM uses (it wins over the body's)."""
    module = importlib.import_module("vllm.entrypoints.openai.completion.serving")
    base_request_id = module.OpenAIServingCompletion._base_request_id
    request = SimpleNamespace(headers={"X-Request-Id": "ab12"})
    assert base_request_id(request, "client-body-id") == "ab12"


def engine_ids(form: str, base: str, size: int, n: int) -> list[tuple[str, int, str]]:
    """Each item's engine ids (one per choice) as vLLM forms them, with the item's index and
    the id the serving code gave it (before vLLM's random suffix and choice prefix)."""
    separator = {"cmpl": "-", "chatcmpl": "_"}[form]
    formed: list[tuple[str, int, str]] = []
    for index in range(size):
        served = f"{form}-{base}{separator}{index}"
        request: Any = SimpleNamespace(
            request_id=served, external_req_id=None, params=SamplingParams(n=n)
        )
        InputProcessor.assign_request_id(request)
        if n == 1:
            formed.append((request.request_id, index, served))
            continue
        parent = ParentRequest(request)
        formed.extend((parent.get_child_info(c)[0], index, f"{c}_{served}") for c in range(n))
    return formed


@pytest.mark.parametrize("randomized", [True, False])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("form", sorted(SERVING))
def test_every_item_id_parses_to_its_own_index(
    form: str, n: int, randomized: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if randomized:
        monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    else:
        monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    base = secrets.token_hex(16)
    size = 12
    listed = PromptList(base, size, n, form=form)
    formed = engine_ids(form, base, size, n)
    assert len(formed) == size * n
    for req_id, index, served in formed:
        assert (req_id == served) != randomized, (req_id, served)  # the suffix as asked for
        assert prompt_index(req_id, listed, randomized) == index, req_id
        # Parsed as the other mode, or as another list, it is no prompt at all.
        assert prompt_index(req_id, listed, not randomized) is None, req_id
        other = PromptList(secrets.token_hex(16), size, n, form=form)
        assert prompt_index(req_id, other, randomized) is None, req_id
