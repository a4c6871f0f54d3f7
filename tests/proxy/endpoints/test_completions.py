"""``POST /v1/completions`` (proxy/endpoints/completions.py, proxy/prompt_list.py): one prompt
gets one vector; a flagged list of prompts is one request (with spans or "all_prompt": fans out,
one request key each; with "mean", a prompt served part of its prompt from the prefix cache is sent
again alone) and gets one entry per prompt, in prompt order."""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    FINAL,
    FakeRing,
    FakeVLLM,
    Hook,
    create_writer,
    error_of,
    forwarded_key,
    is_keyed,
    proxy_client,
    publish,
    publish_for,
    record_for,
    settings_for,
    vector_for,
    wanted_of,
)
from vllm_hidden_state_proxy.protocol import LIST_BASE_ENTRY
from vllm_hidden_state_proxy.proxy.endpoints.completions import merge_completions, prompt_list
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.prompt_list import as_the_clients
from vllm_hidden_state_proxy.request_fields import is_token_ids
from vllm_hidden_state_proxy.ring import PREFIX_GAP_STATUS, ErrorRecord, RingWriter
from vllm_hidden_state_proxy.worker_hook.selection import SelectedRequests

pytestmark = pytest.mark.anyio


@pytest.fixture
def writer(ring_dir: str) -> Iterator[RingWriter]:
    """A real ring of 1024 slots (a list sent as one request takes at most a quarter)."""
    with create_writer(ring_dir, slot_count=1024) as ring:
        yield ring


COMPLETIONS = "/v1/completions"
FLAG = {"return_last_hidden_state": True}


def reply(prompt: Any, n: int = 1) -> dict[str, Any]:
    return {
        "id": f"cmpl-{prompt}",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": i, "text": f"{prompt}/{i}", "finish_reason": "length"} for i in range(n)
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
        "kv_transfer_params": None,
    }


def engine_id(base: str, index: int, choice: int | None) -> str:
    """vLLM 0.32's engine request id of prompt ``index`` (choice ``choice`` of ``n > 1``)."""
    suffix = secrets.token_hex(4)
    return f"{'' if choice is None else f'{choice}_'}cmpl-{base}-{index}-{suffix}"


def is_prompt_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and not is_token_ids(prompt)


class CompletionsVLLM:
    """Publishes each request's record after a random delay, so answers finish out of order;
    answers 400 for ``fail_prompt`` and publishes nothing for ``lost_prompt``. A list sent as
    one request is run as vLLM runs it: one engine request per prompt (and choice), named by
    ``name`` (vLLM's way by default), given ``tokens`` of its prompt, each selected by the
    hook's own code (``SelectedRequests``), which publishes under the key it derives; the
    prompts in ``gaps``, in a list, hit another prompt's cached blocks (the hook's error record
    of status 409), and alone do not."""

    def __init__(
        self,
        hook: Hook,
        fail_prompt: str | None = None,
        lost_prompt: str | None = None,
        name: Callable[[str, int, int | None], str] = engine_id,
        tokens: Callable[[Any], list[int] | None] = lambda p: p if is_token_ids(p) else None,
        gaps: tuple[Any, ...] = (),
    ) -> None:
        self.hook = hook
        self.fail_prompt = fail_prompt
        self.lost_prompt = lost_prompt
        self.gaps = gaps
        self.name = name
        self.tokens = tokens
        self.keys: dict[str, bytes] = {}  # prompt (as JSON) -> the key it was published under
        self.sent: list[httpx.Request] = []
        self.list_keys: list[list[bytes]] = []  # per list request: each prompt's key

    def key_of(self, prompt: Any) -> bytes:
        return self.keys[orjson.dumps(prompt).decode()]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        document = orjson.loads(request.content)
        prompt = document["prompt"]
        prompts = prompt if is_prompt_list(prompt) else [prompt]
        if self.fail_prompt in prompts:
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        await anyio.sleep(random.uniform(0, 0.005))
        n = document.get("n", 1)
        base = request.headers.get("x-request-id") or document.get("request_id") or "r"
        xargs = document.get("vllm_xargs") or {}
        if is_keyed(request) and LIST_BASE_ENTRY in xargs:
            self._run_list(request, prompts, n, base, xargs)
        elif is_keyed(request) and prompt != self.lost_prompt:
            self.keys[orjson.dumps(prompt).decode()] = publish_for(self.hook, request)
        if not is_prompt_list(prompt):
            return httpx.Response(200, json=reply(prompt, n))
        parts = [reply(p, n) for p in prompts]
        return httpx.Response(200, json={**merge_completions(parts), "id": f"cmpl-{base}"})

    def _run_list(
        self, request: httpx.Request, prompts: list[Any], n: int, base: str, xargs: Any
    ) -> None:
        layers, pooling = wanted_of(request)
        selected = SelectedRequests(tuple(range(FINAL + 1)), FINAL)
        first_ids = []
        for index, prompt in enumerate(prompts):
            ids = [self.name(base, index, c if n > 1 else None) for c in range(n)]
            first_ids.append(ids[0])
            params = SimpleNamespace(extra_args=xargs, max_tokens=None)
            selected.observe(
                [
                    SimpleNamespace(
                        req_id=rid, sampling_params=params, prompt_token_ids=self.tokens(prompt)
                    )
                    for rid in ids
                ],
                finished_req_ids=(),
            )
        self.list_keys.append([s.key for rid, s in selected.pending.items() if rid in first_ids])
        for prompt, rid in zip(prompts, first_ids, strict=True):
            selection = selected.pending.get(rid)
            if selection is None or prompt == self.lost_prompt:
                continue  # an error under the list's key was published for an earlier one
            self.keys[orjson.dumps(prompt).decode()] = selection.key
            if selection.problem is not None:
                publish(self.hook, ErrorRecord(selection.key, selection.problem))
                selected.mark_published(rid, selection.key)
                continue
            if prompt in self.gaps:
                gap = "positions 0..15 were served from the prefix cache"
                publish(self.hook, ErrorRecord(selection.key, gap, PREFIX_GAP_STATUS))
                continue
            count = len(prompt) if is_token_ids(prompt) else 5
            publish(
                self.hook,
                record_for(selection.key, layers, pooling, num_prompt_tokens=count),
            )


async def test_a_list_of_prompts_gets_one_vector_each_in_prompt_order(
    ring_dir: str, writer: RingWriter
) -> None:
    prompts: list[Any] = ["a", "b", "h", "c", "d", "e", "f", "g"]
    handler = CompletionsVLLM(writer)
    settings = settings_for(ring_dir, fan_out_limit=3)
    async with proxy_client(settings, FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"model": "m", "prompt": prompts, "n": 2, "kv_transfer_params": FLAG}
        )
        assert proxy.metrics.requests["flagged"] == 1
    assert response.status_code == 200, response.text
    body = response.json()
    vectors = body["kv_transfer_params"]["last_hidden_states"]
    assert vectors == [vector_for(handler.key_of(p)) for p in prompts]
    assert len(set(handler.keys.values())) == len(prompts)  # one key per prompt
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(prompts)))
    assert [c["text"] for c in body["choices"][:4]] == ["a/0", "a/1", "b/0", "b/1"]
    assert body["usage"] == {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40}
    (sent,) = handler.sent  # one request for the whole list
    assert body["id"] == f"cmpl-{sent.headers['x-request-id']}"


async def test_token_id_lists_are_one_request_too(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer)
    prompts = [[1, 2], [3], [4, 5, 6]]
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": prompts, "kv_transfer_params": FLAG}
        )
    kv = response.json()["kv_transfer_params"]
    assert kv["last_hidden_states"] == [vector_for(handler.key_of(p)) for p in prompts]


async def test_single_prompt_forms_get_the_singular_field(
    ring_dir: str, writer: RingWriter
) -> None:
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        for prompt in ("hello", [1, 2, 3]):
            response = await proxy.client.post(
                COMPLETIONS,
                json={
                    "prompt": prompt,
                    "kv_transfer_params": {**FLAG, "last_hidden_state_info": True},
                },
            )
            assert response.status_code == 200, response.text
            kv = response.json()["kv_transfer_params"]
            assert kv["last_hidden_state"] == vector_for(handler.key_of(prompt))
            # The fake's record of a text has 5 tokens; of token ids, their count.
            position = len(prompt) - 1 if isinstance(prompt, list) else 4
            assert kv["last_hidden_state_info"]["position"] == position


async def test_a_list_with_infos(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={"prompt": ["x"], "kv_transfer_params": {**FLAG, "last_hidden_state_info": True}},
        )
    kv = response.json()["kv_transfer_params"]
    assert len(kv["last_hidden_states"]) == 1
    assert [info["num_prompt_tokens"] for info in kv["last_hidden_state_infos"]] == [5]


async def test_a_list_with_layers_gets_one_object_per_prompt(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    handler = CompletionsVLLM(layered_writer)
    prompts = ["p", "q", "r"]
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={
                "prompt": prompts,
                "kv_transfer_params": {
                    **FLAG,
                    "last_hidden_state_layers": [0, -1],
                    "last_hidden_state_pooling": "mean",
                    "last_hidden_state_info": True,
                },
            },
        )
    assert response.status_code == 200, response.text
    kv = response.json()["kv_transfer_params"]
    keys = [handler.key_of(p) for p in prompts]
    assert kv["last_hidden_states_by_layer"] == [
        {"0": vector_for(k, 0, "mean"), "-1": vector_for(k, 4, "mean")} for k in keys
    ]
    assert kv["last_hidden_states"] == [vector_for(k, 4, "mean") for k in keys]
    assert [info["layers"] for info in kv["last_hidden_state_infos"]] == [[0, -1]] * 3
    assert [info["pooling"] for info in kv["last_hidden_state_infos"]] == ["mean"] * 3
    assert len(handler.sent) == 1  # "mean": one request, under one fresh cache_salt
    assert "cache_salt" in orjson.loads(handler.sent[0].content)


@pytest.mark.parametrize("prompts", [["p", "q", "r", "s"], [[1, 2, 3], [1, 2, 3, 4], [5], [6, 7]]])
async def test_a_mean_served_from_the_prefix_cache_is_fetched_alone(
    ring_dir: str, writer: RingWriter, prompts: list[Any]
) -> None:
    """A prompt of a mean list that hit another's cached blocks (the hook's 409) is sent again
    alone, for its vector only: one token, one choice, its own key, id and cache_salt; its
    choices stay the list's."""
    gaps = (prompts[1], prompts[3])
    handler = CompletionsVLLM(writer, gaps=gaps)
    body = {
        "prompt": prompts,
        "n": 2,
        "max_tokens": 7,
        "logprobs": 2,
        "echo": True,
        "temperature": 0.5,
        "add_special_tokens": False,
        "vllm_xargs": {"client": 1},
        "kv_transfer_params": {**FLAG, "last_hidden_state_pooling": "mean"},
    }
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    keys = [handler.key_of(p) for p in prompts]  # the alone requests' keys for the gaps
    assert answer["kv_transfer_params"]["last_hidden_states"] == [
        vector_for(k, FINAL, "mean") for k in keys
    ]
    assert len(answer["choices"]) == 2 * len(prompts)  # the list's reply
    listed, *alone = (orjson.loads(request.content) for request in handler.sent)
    assert [sent["prompt"] for sent in alone] == list(gaps)
    for sent, request in zip(alone, handler.sent[1:], strict=True):
        assert sent["max_tokens"] == 1
        assert not {"n", "logprobs", "echo", "request_id"} & set(sent)
        assert sent["temperature"] == 0.5 and sent["add_special_tokens"] is False
        assert sent["vllm_xargs"]["client"] == 1
        assert request.headers["x-request-id"] != handler.sent[0].headers["x-request-id"]
    salts = [listed["cache_salt"], *(sent["cache_salt"] for sent in alone)]
    assert len(set(salts)) == len(salts)
    assert len(set(keys)) == len(prompts)


async def test_a_mean_list_fails_if_a_prompt_sent_alone_fails(
    ring_dir: str, writer: RingWriter
) -> None:
    """vLLM refusing a prompt alone that it took in the list: a 502 naming the prompt."""
    handler = CompletionsVLLM(writer, gaps=("q",))

    async def refuse_alone(request: httpx.Request) -> httpx.Response:
        if orjson.loads(request.content)["prompt"] == "q":
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        return await handler(request)

    body = {
        "prompt": ["p", "q"],
        "kv_transfer_params": {**FLAG, "last_hidden_state_pooling": "mean"},
    }
    async with proxy_client(settings_for(ring_dir), FakeVLLM(refuse_alone)) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=body)
    assert response.status_code == 502, response.text
    message = response.json()["error"]["message"]
    assert "Prompt 1 of the list" in message and "400" in message and "too long" in message


async def test_a_list_with_layers_but_not_the_final_one(
    ring_dir: str, layered_writer: RingWriter
) -> None:
    handler = CompletionsVLLM(layered_writer)
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS,
            json={
                "prompt": ["p", "q"],
                "kv_transfer_params": {**FLAG, "last_hidden_state_layers": [2]},
            },
        )
    kv = response.json()["kv_transfer_params"]
    assert set(kv) == {"last_hidden_states_by_layer"}
    assert kv["last_hidden_states_by_layer"] == [
        {"2": vector_for(handler.key_of(p), 2)} for p in ("p", "q")
    ]


async def test_one_failing_prompt_fails_the_request_with_vllms_error(
    ring_dir: str, writer: RingWriter
) -> None:
    handler = CompletionsVLLM(writer, fail_prompt="bad")
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["ok", "bad", "ok2"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "too long", "code": 400}}


async def test_a_missing_vector_for_one_prompt_is_504(ring_dir: str, writer: RingWriter) -> None:
    handler = CompletionsVLLM(writer, lost_prompt="lost")
    settings = settings_for(ring_dir, vector_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["a", "lost", "b"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


@pytest.mark.parametrize(
    "reply_body",
    [
        {"id": "x", "choices": [], "usage": {"prompt_tokens": "abc"}},
        {"id": "x", "choices": 5},
    ],
    ids=["usage-not-a-number", "choices-not-a-list"],
)
async def test_replies_that_cannot_be_merged_are_502(reply_body: dict[str, Any]) -> None:
    ring = FakeRing()

    async def handle(request: httpx.Request) -> httpx.Response:
        publish_for(ring, request)
        return httpx.Response(200, json=reply_body)

    async with proxy_client(settings_for("/unused"), FakeVLLM(handle), ring) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": ["a", "b"], "kv_transfer_params": FLAG}
        )
    assert response.status_code == 502
    assert "cannot be merged" in error_of(response)["message"]


async def test_an_unflagged_list_goes_to_vllm_as_one_request() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=reply("list"))

    vllm = FakeVLLM(handle)
    async with proxy_client(settings_for("/unused"), vllm, FakeRing()) as proxy:
        response = await proxy.client.post(COMPLETIONS, json={"prompt": ["a", "b"]})
    assert response.status_code == 200
    assert len(vllm.requests) == 1


async def test_a_flagged_single_prompt_stream_is_served(ring_dir: str, writer: RingWriter) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        publish_for(writer, request)
        event = orjson.dumps({"id": "c", "choices": [{"index": 0, "text": key.hex()[:4]}]})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=b"data: " + event + b"\n\ndata: [DONE]\n\n",
        )

    async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": "x", "stream": True, "kv_transfer_params": FLAG}
        )
    first = orjson.loads(response.content.split(b"\n\n")[0][len(b"data: ") :])
    assert "last_hidden_state" in first["kv_transfer_params"]


# ---------------------------------------------------------------------------------------------
# prompt_list and merge_completions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"prompt": "x"}, None),
        ({}, None),
        ({"prompt": [1, 2]}, None),
        ({"prompt": ["x"]}, ["x"]),
        ({"prompt": ["x", "y"], "stream": False}, ["x", "y"]),
        ({"prompt": [[3], [1, 2]]}, [[3], [1, 2]]),
        ({"prompt_embeds": "AAAA"}, None),
        ({"prompt_embeds": ["AAAA"]}, None),
    ],
)
def test_prompt_list(document: dict[str, Any], expected: list[Any] | None) -> None:
    assert prompt_list(document, 2048) == expected


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [True, 1]}, "prompt"),
        ({"prompt": ["a", {"x": 1}]}, "prompt"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # vLLM takes no mixed lists either
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "stream"),
        ({"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt_embeds": ["AAAA", "BBBB"]}, "prompt_embeds"),
    ],
)
def test_prompt_list_refusals(document: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        prompt_list(document, 2048)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("prompt", [["x"] * 3, [[1]] * 3])
def test_prompt_list_over_the_limit_is_refused_naming_it(prompt: list[Any]) -> None:
    assert prompt_list({"prompt": prompt[:2]}, 2) == prompt[:2]
    with pytest.raises(ProxyError) as caught:
        prompt_list({"prompt": prompt}, 2)
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert "list of 3 prompts" in caught.value.message
    assert "at most 2" in caught.value.message and "--max-prompts" in caught.value.message


def test_merge_renumbers_choices_and_sums_usage() -> None:
    merged = merge_completions([reply("a", 2), reply("b", 1)])
    assert merged["id"] == "cmpl-a"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a/0"),
        (1, "a/1"),
        (2, "b/0"),
    ]
    assert merged["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}


def test_merge_sums_cached_tokens_and_drops_per_stream_metrics() -> None:
    parts = [reply("a"), reply("b")]
    for part in parts:
        part["usage"]["prompt_tokens_details"] = {"cached_tokens": 2}
        part["metrics"] = {"ttft": 1.0}
    merged = merge_completions(parts)
    assert merged["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert merged["metrics"] is None


def test_merge_without_usage_adds_none() -> None:
    parts = [{**reply("a"), "usage": None}, {**reply("b"), "usage": None}]
    assert merge_completions(parts)["usage"] is None


HOSTILE_IDS = ["x-5-deadbeef", "3_y", "7" * 10_000, "\u00e9t\u00e9-\u0663", "cmpl-0-0-00000000"]


@pytest.mark.parametrize("client_id", HOSTILE_IDS)
@pytest.mark.parametrize("where", ["header", "body"])
async def test_the_clients_request_id_is_never_sent_for_a_list(
    ring_dir: str, writer: RingWriter, client_id: str, where: str
) -> None:
    handler = CompletionsVLLM(writer)
    prompts: list[Any] = [[1, 2, 3], [1, 2], [7], [1, 2, 3]]
    document: dict[str, Any] = {"prompt": prompts, "kv_transfer_params": FLAG}
    headers: dict[bytes, bytes] = {}
    if where == "header":
        headers[b"x-request-id"] = client_id.encode("utf-8")
    else:
        document["request_id"] = client_id
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=document, headers=headers)
    assert response.status_code == 200, response.text
    (sent,) = handler.sent
    base = sent.headers["x-request-id"]
    assert len(base) == 32 and set(base) <= set("0123456789abcdef")
    assert orjson.loads(sent.content)["request_id"] == base
    assert [k.lower() for k, _ in sent.headers.raw].count(b"x-request-id") == 1
    body = response.json()
    expected = client_id.encode("utf-8").decode("latin-1") if where == "header" else client_id
    assert body["id"] == f"cmpl-{expected}"  # as vLLM would have named it
    kv = body["kv_transfer_params"]
    # Equal prompts get equal vectors of their own keys: each its own record.
    assert kv["last_hidden_states"] == [vector_for(selection) for selection in handler.list_keys[0]]
    assert len(set(handler.list_keys[0])) == len(prompts)


def named_otherwise(base: str, index: int, choice: int | None) -> str:
    return engine_id(base, (index + 1) % 3, choice)  # prompts 0, 1, 2 named 1, 2, 0


@pytest.mark.parametrize(
    ("name", "tokens", "expected"),
    [
        (lambda base, i, c: f"x-{i}-deadbeef", None, "is not a prompt of the list"),
        (lambda base, i, c: f"cmpl-{base}-{i}", None, "is not a prompt of the list"),
        (named_otherwise, None, "other token ids"),
        (engine_id, lambda p: p[1:], "tokens in vLLM, not the"),
    ],
)
async def test_a_prompt_vllm_runs_otherwise_gets_an_error_not_another_vector(
    ring_dir: str,
    writer: RingWriter,
    name: Callable[[str, int, int | None], str],
    tokens: Callable[[Any], list[int] | None] | None,
    expected: str,
) -> None:
    handler = CompletionsVLLM(writer, name=name, tokens=tokens or (lambda p: p))
    prompts = [[5, 6, 7], [5, 6, 8], [5, 6, 9]]  # one length: only the checksum tells
    async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
        response = await proxy.client.post(
            COMPLETIONS, json={"prompt": prompts, "kv_transfer_params": FLAG}
        )
    assert response.status_code == 502, response.text
    assert expected in error_of(response)["message"]


async def test_a_list_too_large_for_a_quarter_of_the_ring_fans_out(ring_dir: str) -> None:
    with create_writer(ring_dir) as small:  # 16 slots: one request takes at most 4 records
        handler = CompletionsVLLM(small)
        async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
            four = await proxy.client.post(
                COMPLETIONS, json={"prompt": list("abcd"), "kv_transfer_params": FLAG}
            )
            assert len(handler.sent) == 1
            five = await proxy.client.post(
                COMPLETIONS, json={"prompt": list("vwxyz"), "kv_transfer_params": FLAG}
            )
    assert four.status_code == five.status_code == 200, five.text
    assert len(handler.sent) == 1 + 5
    vectors = five.json()["kv_transfer_params"]["last_hidden_states"]
    assert vectors == [vector_for(handler.key_of(p)) for p in "vwxyz"]


class BusyVLLM(CompletionsVLLM):
    """Runs the list, then, before its reply, other traffic fills the ring many times over."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        response = await super().__call__(request)
        await anyio.sleep(0.3)  # the proxy looks for the records meanwhile
        for _ in range(100):
            publish(self.hook, record_for(secrets.token_bytes(16)))
        return response


async def test_a_lists_records_are_picked_up_before_other_traffic_overwrites_them(
    ring_dir: str,
) -> None:
    with create_writer(ring_dir) as small:  # 16 slots, overwritten six times before the reply
        handler = BusyVLLM(small)
        async with proxy_client(settings_for(ring_dir), FakeVLLM(handler)) as proxy:
            response = await proxy.client.post(
                COMPLETIONS, json={"prompt": list("abcd"), "kv_transfer_params": FLAG}
            )
    assert response.status_code == 200, response.text
    vectors = response.json()["kv_transfer_params"]["last_hidden_states"]
    assert vectors == [vector_for(handler.key_of(p)) for p in "abcd"]


@pytest.mark.parametrize("client_id", ["plain", "\u00e9t\u00e9", "\u0663" * 3])
def test_the_reply_is_named_by_the_clients_id(client_id: str) -> None:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"0" * 32)]
    named, completion = as_the_clients(headers, {"id": "cmpl-" + "0" * 32}, client_id, "cmpl")
    assert completion["id"] == f"cmpl-{client_id}"
    latin = client_id.isascii() or all(ord(c) < 256 for c in client_id)
    assert named[1] == (b"x-request-id", client_id.encode("latin-1") if latin else b"0" * 32)
    assert as_the_clients(headers, completion, None, "cmpl") == (headers, completion)
