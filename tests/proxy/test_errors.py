"""The errors the proxy answers itself (proxy/errors.py): the OpenAI shape, and factories whose
messages name the fix."""

from __future__ import annotations

import orjson
import pytest

from vllm_hidden_state_proxy.proxy.errors import (
    ProxyError,
    bad_request,
    body_too_large,
    engines_without_ring,
    hook_error,
    no_ring,
    record_mismatch,
    vector_overwritten,
    vector_timeout,
)
from vllm_hidden_state_proxy.ring import EngineFailure


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (413, "invalid_request_error"),
        (502, "bad_gateway"),
        (503, "service_unavailable"),
        (504, "gateway_timeout"),
        (500, "proxy_error"),
    ],
)
def test_the_openai_error_shape(status: int, kind: str) -> None:
    error = ProxyError(status, "what went wrong", "field")
    assert orjson.loads(error.body()) == {
        "error": {"message": "what went wrong", "type": kind, "param": "field", "code": status}
    }
    assert str(error) == f"{status}: what went wrong"


def test_the_factories_name_the_fix() -> None:
    assert (bad_request("x").status, bad_request("x", "p").param) == (400, "p")
    assert "1024 bytes" in body_too_large(1024).message
    missing = no_ring("/dev/shm/rings")
    assert missing.status == 503
    for part in ("/dev/shm/rings", "hidden_state_hook", "VLLM_PLUGINS", "vllm.general_plugins"):
        assert part in missing.message
    failures = [EngineFailure(0xA, 1, 11, "first"), EngineFailure(0xA, 2, 12, "second")]
    engines = engines_without_ring(failures)
    assert engines.status == 503
    assert "engine 1" in engines.message and "engine 2" in engines.message
    assert "first" in engines.message and "second" in engines.message
    assert "restart vLLM" in engines.message
    assert hook_error("oom").status == 502 and hook_error("oom").message.endswith(": oom")
    mismatch = record_mismatch((4,), "last", (0, 4), "mean")
    assert mismatch.status == 502
    assert "layers 4 (last pooling)" in mismatch.message
    assert "layers 0, 4 (mean pooling)" in mismatch.message
    timeout = vector_timeout(2.5)
    assert timeout.status == 504 and "within 2.5 s" in timeout.message
    overwritten = vector_overwritten(1024)
    assert overwritten.status == 504
    assert "(1024 slots)" in overwritten.message
    assert "HIDDEN_STATE_PROXY_RING_SLOTS" in overwritten.message
