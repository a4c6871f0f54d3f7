"""The work one request causes is bounded before it starts (issue #25), on the real stack.

Before: 200,000 flagged prompts in a ~1 MB body took 1.3 GB of the proxy's memory and would
have become 200,000 vLLM requests; 200,000 layer labels blocked the event loop ~0.3 s per
prompt. Now both are a 400 naming the field and the limit, read before any work per entry,
and the proxy's memory stays where it was.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests.e2e.server import SERVED_MODEL_NAME, RunningStack
from tests.e2e.stack_probe import proxy_process, rss

FLAG = {"return_last_hidden_state": True}
MIB = 1 << 20


def post(stack: RunningStack, path: str, body: dict[str, Any]) -> httpx.Response:
    # The client's timeout bounds "within seconds"; nothing here times the proxy itself.
    return httpx.post(
        stack.proxy_url + path,
        content=orjson.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )


def test_200000_prompts_and_200000_layers_get_a_400_with_the_proxy_s_memory_bounded(
    stack: RunningStack,
) -> None:
    proxy = proxy_process(stack)
    before = rss(proxy)
    prompts = post(
        stack,
        "/v1/completions",
        {
            "model": SERVED_MODEL_NAME,
            "prompt": ["x"] * 200_000,
            "max_tokens": 1,
            "kv_transfer_params": FLAG,
        },
    )
    layers = post(
        stack,
        "/v1/chat/completions",
        {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "kv_transfer_params": {**FLAG, "last_hidden_state_layers": [0] * 200_000},
        },
    )
    after = rss(proxy)
    assert prompts.status_code == 400, prompts.text
    error = prompts.json()["error"]
    assert error["param"] == "prompt" and "at most 2048" in error["message"]
    assert layers.status_code == 400, layers.text
    error = layers.json()["error"]
    assert error["param"] == "kv_transfer_params.last_hidden_state_layers"
    assert "at most 1024" in error["message"]
    # The parsed bodies are all the proxy held (a few MiB), not a document per prompt.
    assert after - before < 64 * MIB, f"proxy RSS grew {(after - before) / MIB:.0f} MiB"
    # And it serves on: a flagged list at the limit's scale still works.
    served = post(
        stack,
        "/v1/completions",
        {
            "model": SERVED_MODEL_NAME,
            "prompt": ["a", "b"],
            "max_tokens": 1,
            "kv_transfer_params": {**FLAG, "last_hidden_state_layers": [0, 0, -1]},
        },
    )
    assert served.status_code == 200, served.text
    by_layer = served.json()["kv_transfer_params"]["last_hidden_states_by_layer"]
    assert [sorted(entry) for entry in by_layer] == [["-1", "0"], ["-1", "0"]]  # deduplicated
