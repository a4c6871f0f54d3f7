"""Bad input gets a clear OpenAI-shaped error and the server keeps serving; /health, /metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import MAX_BODY_SIZE, MAX_MODEL_LEN, RunningStack
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY

CHAT = "/v1/chat/completions"


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 1,
        **extra,
    }


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (
            {"kv_transfer_params": {"return_last_hidden_state": "yes"}},
            "kv_transfer_params.return_last_hidden_state",
        ),
        (
            {
                "kv_transfer_params": {
                    "return_last_hidden_state": True,
                    "last_hidden_state_format": "float16",
                }
            },
            "kv_transfer_params.last_hidden_state_format",
        ),
        (
            {
                "kv_transfer_params": {
                    "return_last_hidden_state": True,
                    "last_hidden_state_format": ["base64"],
                }
            },
            "kv_transfer_params.last_hidden_state_format",
        ),
        (
            {
                "kv_transfer_params": {
                    "return_last_hidden_state": True,
                    "last_hidden_state_info": 1,
                }
            },
            "kv_transfer_params.last_hidden_state_info",
        ),
        ({"kv_transfer_params": {"return_last_hidden_state": True}, "stream": "maybe"}, "stream"),
        (
            {
                "kv_transfer_params": {"return_last_hidden_state": True},
                "vllm_xargs": {REQUEST_KEY_ENTRY: "00" * 16},
            },
            "vllm_xargs",
        ),
        ({"vllm_xargs": {REQUEST_KEY_ENTRY: "00" * 16}}, "vllm_xargs"),
    ],
)
def test_bad_flagged_input_is_a_400_naming_the_field(
    stack: RunningStack, model_name: str, payload: dict[str, Any], param: str
) -> None:
    response = httpx.post(stack.proxy_url + CHAT, json=body(model_name, **payload), timeout=30)
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    "raw",
    [
        b"[1, 2]",
        b"{not json",
        b'"return_last_hidden_state"',
        b'{"kv_transfer_params": {"return_last_hidden_state": true}, "x": "\xff\xfe"}',
        b'{"kv_transfer_params": {"return_last_hidden_state": true}, "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}",
    ],
    ids=["array", "invalid-json", "string", "invalid-utf8", "nesting-too-deep"],
)
def test_a_body_that_is_not_a_json_object_is_a_400(stack: RunningStack, raw: bytes) -> None:
    response = httpx.post(
        stack.proxy_url + CHAT,
        content=raw.replace(b"not json", b'"return_last_hidden_state": tru'),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_openai_error(response, 400, None)


def test_a_body_over_the_limit_is_a_413(stack: RunningStack, model_name: str) -> None:
    padding = "x" * (MAX_BODY_SIZE + 1)
    payload = body(model_name, kv_transfer_params={"return_last_hidden_state": True}, pad=padding)
    response = httpx.post(stack.proxy_url + CHAT, json=payload, timeout=30)
    assert_openai_error(response, 413, None)


def test_a_prompt_longer_than_the_context_is_vllms_400_unchanged(
    stack: RunningStack, model_name: str
) -> None:
    long_text = "word " * (MAX_MODEL_LEN * 2)
    for path, payload in (
        (CHAT, body(model_name, messages=[{"role": "user", "content": long_text}])),
        ("/v1/completions", {"model": model_name, "prompt": long_text, "max_tokens": 1}),
    ):
        direct = httpx.post(
            stack.vllm_url + path, json=payload, headers=stack.vllm_headers, timeout=60
        )
        flagged = {**payload, "kv_transfer_params": {"return_last_hidden_state": True}}
        via_proxy = httpx.post(stack.proxy_url + path, json=flagged, timeout=60)
        assert direct.status_code == via_proxy.status_code == 400
        assert via_proxy.json() == direct.json()


def test_vllm_errors_pass_through_unchanged(stack: RunningStack) -> None:
    payload = body("no-such-model", kv_transfer_params={"return_last_hidden_state": True})
    via_proxy = httpx.post(stack.proxy_url + CHAT, json=payload, timeout=30)
    plain = body("no-such-model")
    direct = httpx.post(stack.vllm_url + CHAT, json=plain, headers=stack.vllm_headers, timeout=30)
    assert via_proxy.status_code == direct.status_code == 404
    assert via_proxy.json() == direct.json()


def test_the_server_keeps_serving_after_bad_input(
    stack: RunningStack, client: Any, model_name: str, reference: Reference
) -> None:
    for _ in range(3):
        httpx.post(stack.proxy_url + CHAT, content=b"\xff\xfe{", timeout=30)
        httpx.post(
            stack.proxy_url + CHAT,
            json=body(model_name, kv_transfer_params={"return_last_hidden_state": 1}),
            timeout=30,
        )
    messages = [{"role": "user", "content": "Still alive?"}]
    response = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=1,
        extra_body={"kv_transfer_params": {"return_last_hidden_state": True}},
    )
    vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
    assert_matches(vector, reference.last_hidden_state(reference.chat_token_ids(messages)))


def test_health_follows_vllm(stack: RunningStack) -> None:
    assert httpx.get(stack.proxy_url + "/health", timeout=10).status_code == 200


def test_vllm_starts_the_hook_once_without_warnings_about_our_settings(
    stack: RunningStack, model_name: str
) -> None:
    flagged = body(model_name, kv_transfer_params={"return_last_hidden_state": True})
    assert httpx.post(stack.proxy_url + CHAT, json=flagged, timeout=30).status_code == 200
    log = stack.log_path.read_text(errors="replace")
    assert log.count("worker hook active (v1 runner)") == 1
    assert "Unknown vLLM environment variable" not in log
    assert "Got kv_transfer_params, but no KVConnector" not in log  # the flag was stripped


def test_metrics_include_vllm_and_proxy_metrics(
    stack: RunningStack, client: Any, model_name: str
) -> None:
    client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "metrics"}],
        max_completion_tokens=1,
        extra_body={"kv_transfer_params": {"return_last_hidden_state": True}},
    )
    text = httpx.get(stack.proxy_url + "/metrics", timeout=10).text
    assert "vllm:prefix_cache_hits_total" in text
    flagged = [
        line
        for line in text.splitlines()
        if line.startswith("hidden_state_proxy_flagged_requests_total")
    ]
    assert flagged and float(flagged[0].rsplit(" ", 1)[1]) >= 1


def test_other_paths_pass_through(stack: RunningStack, model_name: str) -> None:
    via_proxy = httpx.get(stack.proxy_url + "/v1/models", timeout=10)
    direct = httpx.get(stack.vllm_url + "/v1/models", headers=stack.vllm_headers, timeout=10)
    assert via_proxy.status_code == 200
    assert [m["id"] for m in via_proxy.json()["data"]] == [m["id"] for m in direct.json()["data"]]
    tokenized = httpx.post(
        stack.proxy_url + "/tokenize", json={"model": model_name, "prompt": "hello"}, timeout=10
    )
    assert tokenized.status_code == 200 and tokenized.json()["tokens"]
