"""``POST /v1/chat/completions/batch`` (proxy/endpoints/chat_batch.py): a flagged batch is one
vLLM request whose conversations the hook tells apart by their engine ids
(``chatcmpl-{base}_{i}``), one entry per conversation in order; an ordinary one passes through."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    FakeVLLM,
    Hook,
    create_writer,
    error_of,
    proxy_client,
    publish,
    record_for,
    settings_for,
    vector_for,
    wanted_of,
)
from vllm_hidden_state_proxy.protocol import LIST_BASE_ENTRY, REQUEST_KEY_ENTRY
from vllm_hidden_state_proxy.ring import ErrorRecord, RingWriter
from vllm_hidden_state_proxy.worker_hook.selection import SelectedRequests

pytestmark = pytest.mark.anyio


@pytest.fixture
def writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring of 1024 slots (a list sent as one request takes at most a quarter)."""
    with create_writer(ring_dir, slot_count=1024) as ring:
        yield ring


BATCH = "/v1/chat/completions/batch"
FLAG = {"return_last_hidden_state": True}
CONVERSATIONS = [[{"role": "user", "content": f"question {i}"}] for i in range(5)]


def batch_id(base: str, index: int) -> str:
    """vLLM 0.32's engine request id of conversation ``index`` (batch_serving.py)."""
    return f"chatcmpl-{base}_{index}-{secrets.token_hex(4)}"


class BatchVLLM:
    """vLLM's batch endpoint: one engine request per conversation, named by ``name``, each
    selected by the hook's own code, which publishes under the key it derives."""

    def __init__(self, hook: Hook, name: Callable[[str, int], str] = batch_id) -> None:
        self.hook = hook
        self.name = name
        self.keys: list[bytes] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        document = orjson.loads(request.content)
        conversations = document["messages"]
        base = request.headers.get("x-request-id") or "r"
        xargs = document.get("vllm_xargs") or {}
        if LIST_BASE_ENTRY in xargs:
            layers, pooling = wanted_of(request)
            selected = SelectedRequests(tuple(range(FINAL + 1)), FINAL)
            params = SimpleNamespace(extra_args=xargs, max_tokens=None)
            ids = [self.name(base, i) for i in range(len(conversations))]
            selected.observe(
                [SimpleNamespace(req_id=rid, sampling_params=params) for rid in ids], ()
            )
            for rid in ids:
                selection = selected.pending.get(rid)
                if selection is None:
                    continue
                self.keys.append(selection.key)
                if selection.problem is not None:
                    publish(self.hook, ErrorRecord(selection.key, selection.problem))
                    selected.mark_published(rid, selection.key)
                else:
                    publish(self.hook, record_for(selection.key, layers, pooling))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": f"answer {i}"},
                "finish_reason": "length",
            }
            for i in range(len(conversations))
        ]
        return httpx.Response(
            200,
            json={
                "id": f"chatcmpl-{base}",
                "object": "chat.completion",
                "model": "m",
                "choices": choices,
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            },
        )


@pytest.mark.parametrize("client_id", [None, "x-5-deadbeef", "3_y"])
async def test_a_flagged_batch_is_one_request_with_a_vector_per_conversation(
    ring_dir: str, writer: RingWriter, client_id: str | None
) -> None:
    handler = BatchVLLM(writer)
    vllm = FakeVLLM(handler)
    headers = {} if client_id is None else {"x-request-id": client_id}
    document = {"model": "m", "messages": CONVERSATIONS, "kv_transfer_params": FLAG}
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(BATCH, json=document, headers=headers)
    assert response.status_code == 200, response.text
    (sent,) = vllm.requests
    base = sent.headers["x-request-id"]
    assert len(base) == 32 and base != client_id
    body = response.json()
    assert body["kv_transfer_params"]["last_hidden_states"] == [vector_for(k) for k in handler.keys]
    assert len(set(handler.keys)) == len(CONVERSATIONS)
    assert body["id"] == f"chatcmpl-{client_id or base}"
    assert [c["message"]["content"] for c in body["choices"]] == [f"answer {i}" for i in range(5)]


async def test_an_ordinary_batch_passes_through_unchanged() -> None:
    sent: list[bytes] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json={"choices": []})

    raw = orjson.dumps({"model": "m", "messages": CONVERSATIONS})
    async with proxy_client(settings_for("/unused"), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(
            BATCH, content=raw, headers={"content-type": "application/json"}
        )
    assert response.status_code == 200
    assert sent == [raw]


@pytest.mark.parametrize(
    ("document", "param", "text"),
    [
        ({"messages": CONVERSATIONS * 3}, "messages", "--max-prompts"),
        ({"messages": []}, "messages", "non-empty list of conversations"),
        ({"messages": [CONVERSATIONS[0], []]}, "messages", "messages[1]"),
        ({"messages": [CONVERSATIONS[0], "x"]}, "messages", "messages[1]"),
        (
            {
                "messages": CONVERSATIONS,
                "kv_transfer_params": {**FLAG, "last_hidden_state_pooling": "all_prompt"},
            },
            "kv_transfer_params.last_hidden_state_pooling",
            "/v1/chat/completions",
        ),
    ],
)
async def test_refusals(
    ring_dir: str, writer: RingWriter, document: dict[str, Any], param: str, text: str
) -> None:
    vllm = FakeVLLM(BatchVLLM(writer))
    body = {"model": "m", "kv_transfer_params": FLAG, **document}
    async with proxy_client(settings_for(ring_dir, max_prompts=10), vllm) as proxy:
        response = await proxy.client.post(BATCH, json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert text in error_of(response)["message"]
    assert vllm.requests == []


async def test_a_reserved_entry_in_an_ordinary_batch_is_refused() -> None:
    vllm = FakeVLLM(BatchVLLM(None))
    body = {"messages": CONVERSATIONS, "vllm_xargs": {REQUEST_KEY_ENTRY: "00" * 16}}
    async with proxy_client(settings_for("/unused"), vllm) as proxy:
        response = await proxy.client.post(BATCH, json=body)
    assert response.status_code == 400
    assert vllm.requests == []


@pytest.mark.parametrize(
    "name",
    [
        lambda base, i: f"cmpl-{base}-{i}-deadbeef",  # a completions prompt's form
        lambda base, i: f"chatcmpl-{base}_{i}",  # no suffix, though vLLM adds one
        lambda base, i: f"chatcmpl-x_{i}-deadbeef",
    ],
)
async def test_conversations_vllm_names_otherwise_get_an_error(
    ring_dir: str, writer: RingWriter, name: Callable[[str, int], str]
) -> None:
    async with proxy_client(settings_for(ring_dir), FakeVLLM(BatchVLLM(writer, name))) as proxy:
        response = await proxy.client.post(
            BATCH, json={"messages": CONVERSATIONS, "kv_transfer_params": FLAG}
        )
    assert response.status_code == 502, response.text
    assert "is not a prompt of the list" in error_of(response)["message"]


async def test_a_batch_too_large_for_a_quarter_of_the_ring_is_refused(ring_dir: str) -> None:
    with create_writer(ring_dir) as small:  # 16 slots: one request takes at most 4 records
        vllm = FakeVLLM(BatchVLLM(small))
        async with proxy_client(settings_for(ring_dir), vllm) as proxy:
            fits = await proxy.client.post(
                BATCH, json={"messages": CONVERSATIONS[:4], "kv_transfer_params": FLAG}
            )
            refused = await proxy.client.post(
                BATCH, json={"messages": CONVERSATIONS, "kv_transfer_params": FLAG}
            )
    assert fits.status_code == 200, fits.text
    assert refused.status_code == 400
    assert error_of(refused)["param"] == "messages"
    assert "HIDDEN_STATE_PROXY_RING_SLOTS" in error_of(refused)["message"]
    assert len(vllm.requests) == 1
