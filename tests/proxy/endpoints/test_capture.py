"""``GET /v1/hidden_states`` (proxy/endpoints/capture.py): what the server captures, from the live
rings' headers (real rings, as the hook writes them), the proxy's limits and vLLM's models; read
back by the client module (``client.read_capture``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.proxy.fakes import (
    FINAL,
    HIDDEN_SIZE,
    FakeRing,
    FakeVLLM,
    create_writer,
    error_of,
    proxy_client,
    settings_for,
)
from vllm_hidden_state_proxy.client import HiddenStateServerError, read_capture
from vllm_hidden_state_proxy.protocol import CAPTURE_PATH, MAX_LAYERS, MAX_SPANS

pytestmark = pytest.mark.anyio


def models_handler(seen: list[httpx.Request], status: int = 200) -> FakeVLLM:
    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.url.path == "/v1/models"
        return httpx.Response(status, json={"object": "list", "data": [{"id": "tiny-chat"}]})

    return FakeVLLM(handle)


async def test_two_engines_of_one_server_are_described(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    settings = settings_for(str(tmp_path), max_prompts=7)
    with (
        create_writer(tmp_path, (0, 2, FINAL), engine=0, runner="vLLM 0.32.0 V1 X") as first,
        create_writer(tmp_path, (0, FINAL), engine=1, arena_size=1 << 16, max_record=4096),
    ):
        async with proxy_client(settings, models_handler(seen)) as proxy:
            response = await proxy.client.get(CAPTURE_PATH, headers={"authorization": "Bearer k"})
    assert response.status_code == 200
    document = response.json()
    assert document["object"] == "hidden_state_capture"
    assert (document["model"], document["models"]) == ("tiny-chat", ["tiny-chat"])
    assert document["layers"] == [0, FINAL]  # what every engine captures
    assert document["limits"] == {
        "max_prompts": 7,
        "max_spans": MAX_SPANS,
        "max_layers": MAX_LAYERS,
        "max_record_bytes": 4096,  # the smallest engine's
        "arena_bytes": 1 << 16,
        "max_embedding_inputs": settings.max_embedding_inputs,
        "max_body_bytes": settings.max_body_bytes,
        "max_client_connections": settings.max_client_connections,
    }
    assert [e["engine"] for e in document["engines"]] == [0, 1]
    assert document["engines"][0]["layers"] == [0, 2, FINAL]
    assert document["engines"][0]["runner"] == "vLLM 0.32.0 V1 X"
    assert document["engines"][0]["instance"] == f"{first.header.instance:016x}"
    # vLLM's models are read with the client's key (vLLM's --api-key may be the same)
    assert seen[0].headers["authorization"] == "Bearer k"
    capture = read_capture(response)
    assert capture.hidden_size == HIDDEN_SIZE and capture.num_hidden_layers == FINAL
    assert capture.captures(-1) and capture.captures(0) and not capture.captures(2)
    assert capture.poolings == ("last", "mean", "last_answer", "all_prompt", "all_answer")
    assert capture.engines[1].max_record_bytes == 4096


async def test_without_an_arena_matrices_are_not_offered_and_the_upstream_key_is_used() -> None:
    seen: list[httpx.Request] = []
    settings = settings_for("/unused", upstream_api_key="vllm-key")
    async with proxy_client(settings, models_handler(seen), FakeRing()) as proxy:
        response = await proxy.client.get(CAPTURE_PATH, headers={"authorization": "Bearer k"})
    assert response.json()["poolings"] == ["last", "mean", "last_answer"]
    assert response.json()["limits"]["arena_bytes"] == 0
    assert seen[0].headers["authorization"] == "Bearer vllm-key"


async def test_no_ring_is_the_503_a_flagged_request_gets() -> None:
    async with proxy_client(settings_for("/unused"), models_handler([]), FakeRing(False)) as proxy:
        response = await proxy.client.get(CAPTURE_PATH)
    assert response.status_code == 503
    assert "worker hook" in error_of(response)["message"]
    with pytest.raises(HiddenStateServerError) as raised:
        read_capture(response)
    assert raised.value.status == 503


@pytest.mark.parametrize(("status", "answered"), [(401, 401), (500, 502)])
async def test_vllms_models_failing_is_said(status: int, answered: int) -> None:
    async with proxy_client(settings_for("/unused"), models_handler([], status), FakeRing()) as p:
        response = await p.client.get(CAPTURE_PATH)
    assert response.status_code == answered
    assert f"/v1/models answered {status}" in error_of(response)["message"]


async def test_the_proxys_api_key_guards_it() -> None:
    settings = settings_for("/unused", api_key="secret")
    async with proxy_client(settings, models_handler([]), FakeRing()) as proxy:
        response = await proxy.client.get(CAPTURE_PATH)
    assert response.status_code == 401
