"""The proxy reads only ring files owned by a trusted user (its own, root, or --ring-owner-uid)."""

from __future__ import annotations

import os

import pytest

from vllm_hidden_state_proxy.ring import RingWriter

from tests.proxy.fakes import FakeVLLM, error_of, proxy_client, publishing_handler, settings_for

pytestmark = pytest.mark.anyio

FLAGGED = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "kv_transfer_params": {"return_last_hidden_state": True},
}


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
async def test_a_ring_owned_by_an_untrusted_user_is_refused(
    ring_dir: str, writer: RingWriter
) -> None:
    os.chown(writer.path, 4242, -1)
    vllm = FakeVLLM(publishing_handler(writer))
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:  # trusts root and self
        refused = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
    assert refused.status_code == 503
    assert "not active" in error_of(refused)["message"]
    assert vllm.requests == []
    trusting = settings_for(ring_dir, ring_owner_uids=(4242,))
    async with proxy_client(trusting, FakeVLLM(publishing_handler(writer))) as proxy:
        accepted = await proxy.client.post("/v1/chat/completions", json=FLAGGED)
    assert accepted.status_code == 200, accepted.text
