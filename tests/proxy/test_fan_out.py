"""Fanning one client request out (proxy/fan_out.py): bounded, in input order, the first failure
in input order cancels the rest."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.proxy.fakes import (
    AsgiCall,
    FakeRing,
    FakeVLLM,
    completion,
    publish_for,
    record_for,
    settings_for,
)
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.fan_out import Failed, at_path, fetch_all
from vllm_hidden_state_proxy.proxy.keyed_request import JoinableReply, UnchangedReply
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.plan import resolve_layers
from vllm_hidden_state_proxy.request_fields import VectorRequest

pytestmark = pytest.mark.anyio

SCOPE = AsgiCall.scope("POST", "/v1/completions")


class GatedVLLM:
    """Holds every request until ``in_flight`` reach the gate (or ``release`` is set), and
    records the most that were ever in flight at once."""

    def __init__(self, ring: FakeRing, gate: int) -> None:
        self.ring = ring
        self.gate = gate
        self.in_flight = 0
        self.most = 0
        self.cancelled = 0
        self.release = anyio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        prompt = orjson.loads(request.content)["prompt"]
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            if self.in_flight >= self.gate:
                self.release.set()
            if prompt == "refused":
                return httpx.Response(400, content=b"refused")
            if prompt != "fast":
                await self.release.wait()
            if prompt == "slow-refused":
                return httpx.Response(422, content=b"late")
            if prompt != "lost":
                publish_for(self.ring, request)
            return httpx.Response(200, json=completion())
        except BaseException:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


async def run(
    vllm: Any, ring: FakeRing, prompts: list[str], limit: int, timeout: float = 1.0
) -> list[JoinableReply] | Failed:
    settings = settings_for("/unused", fan_out_limit=limit, vector_timeout=timeout)
    app = create_app(settings, FakeVLLM(vllm).transport, ring=ring)
    wanted = resolve_layers(VectorRequest(), ring.live_shapes())
    async with app.router.lifespan_context(app):
        state: ProxyState = app.state.proxy
        with anyio.fail_after(60):
            return await fetch_all(state, [(SCOPE, {"prompt": p}) for p in prompts], wanted)


async def test_replies_come_in_job_order_with_at_most_the_limit_in_flight() -> None:
    ring = FakeRing()
    vllm = GatedVLLM(ring, gate=3)
    replies = await run(vllm, ring, [f"p{i}" for i in range(10)], limit=3)
    assert isinstance(replies, list) and len(replies) == 10
    assert vllm.most == 3
    assert len({reply.record.key for reply in replies}) == 10
    assert all(reply.record == record_for(reply.record.key) for reply in replies)


async def test_a_vllm_error_is_the_failure_and_cancels_the_rest() -> None:
    ring = FakeRing()
    vllm = GatedVLLM(ring, gate=10**6)  # the others wait until cancelled
    result = await run(vllm, ring, ["p0", "refused", "p2", "p3"], limit=4)
    assert isinstance(result, Failed)
    assert result.index == 1
    assert isinstance(result.failure, UnchangedReply)
    assert (result.failure.status, result.failure.content) == (400, b"refused")
    assert vllm.cancelled == 3


async def test_a_failure_after_a_success_is_reported_with_its_index() -> None:
    ring = FakeRing()
    vllm = GatedVLLM(ring, gate=10**6)  # "slow-refused" waits until cancelled
    result = await run(vllm, ring, ["slow-refused", "fast", "refused"], limit=3)
    assert isinstance(result, Failed)
    assert result.index == 2  # the only failure: a request cancelled is none
    assert vllm.cancelled == 1


async def test_a_missing_record_is_a_proxy_error_failure() -> None:
    ring = FakeRing()
    vllm = GatedVLLM(ring, gate=2)
    result = await run(vllm, ring, ["p0", "lost"], limit=2, timeout=0.01)
    assert isinstance(result, Failed) and result.index == 1
    assert isinstance(result.failure, ProxyError) and result.failure.status == 504


def test_at_path_makes_a_post_to_another_path() -> None:
    scope = {**SCOPE, "method": "PUT", "query_string": b"a=1", "headers": [(b"x", b"1")]}
    moved = at_path(scope, "/v1/chat/completions")
    assert (moved["method"], moved["path"], moved["raw_path"], moved["query_string"]) == (
        "POST",
        "/v1/chat/completions",
        b"/v1/chat/completions",
        b"",
    )
    assert moved["headers"] == [(b"x", b"1")]
    assert scope["path"] == "/v1/completions"  # not changed in place
