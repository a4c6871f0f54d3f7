"""check.py: the doctor's steps and the one sentence it ends with, against a scripted proxy
(httpx.MockTransport). The real deployments it is run against are in tests/e2e/test_check.py."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from vllm_hidden_state_proxy import check as check_module
from vllm_hidden_state_proxy.check import CheckFailed, Deployment, canary, check

HIDDEN = 8
LAYERS = (0, 1, 2)


def capture(arena_bytes: int = 1 << 20) -> dict[str, Any]:
    """``GET /v1/hidden_states`` of a two-engine server of a two-layer model."""
    poolings = ["last", "mean", "last_answer"] + (["all_prompt", "all_answer"] * bool(arena_bytes))
    engine = {
        "instance": "00000000000000ab", "runner": "", "hidden_size": HIDDEN,
        "num_hidden_layers": 2, "layers": list(LAYERS), "slots": 16,
        "arena_bytes": arena_bytes, "max_record_bytes": arena_bytes,
    }  # fmt: skip
    return {
        "object": "hidden_state_capture", "model": "tiny", "models": ["tiny"],
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "layers": list(LAYERS),
        "poolings": poolings, "formats": ["float", "base64"],
        "dtypes": ["float32", "float16", "bfloat16"],
        "limits": {"max_prompts": 2048, "max_spans": 1024, "max_layers": 1024,
                   "max_record_bytes": arena_bytes, "arena_bytes": arena_bytes},
        "engines": [{**engine, "engine": 0}, {**engine, "engine": 1}],
    }  # fmt: skip


METRICS = (
    "hidden_state_proxy_live_rings 2\n"
    'hidden_state_proxy_ring_info{instance="00000000000000ab",engine="0",'
    'runner="vLLM 0.33.0 V2 GPUModelRunner"} 1\n'
    'hidden_state_proxy_ring_info{instance="00000000000000ab",engine="1",runner=""} 1\n'
    "hidden_state_proxy_engines_without_ring 0\n"
)


def b64(values: Any) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "code": status}})


class ScriptedProxy:
    """Answers as a healthy proxy does; ``overrides[name]`` replaces one answer."""

    def __init__(self, **overrides: Callable[[dict[str, Any]], httpx.Response]) -> None:
        self.overrides = overrides
        self.seen: list[str] = []

    def answer(self, name: str, body: dict[str, Any], default: httpx.Response) -> httpx.Response:
        self.seen.append(name)
        override = self.overrides.get(name)
        return override(body) if override is not None else default

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET":
            defaults = {
                "/health": httpx.Response(200),
                "/version": httpx.Response(200, json={"version": "0.32.0"}),
                "/metrics": httpx.Response(200, text=METRICS),
                "/v1/models": httpx.Response(200, json={"data": [{"id": "tiny"}]}),
                "/v1/hidden_states": httpx.Response(200, json=capture()),
            }
            return self.answer(path, {}, defaults[path])
        body = json.loads(request.content)
        kv = body.get("kv_transfer_params")
        if kv is None:
            return self.answer("ordinary", body, httpx.Response(200, json={"choices": []}))
        if body.get("stream"):
            chunks = [
                {"choices": [], "kv_transfer_params": {"last_hidden_state": b64([1.0] * HIDDEN)}},
                {"choices": [{"text": "x"}]},
            ]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return self.answer("stream", body, httpx.Response(200, text=text))
        if kv.get("last_hidden_state_pooling") == "all_prompt":
            matrix = {"shape": [4, HIDDEN], "dtype": "float32", "data": b64([0.25] * 4 * HIDDEN)}
            answer = {
                "kv_transfer_params": {"last_hidden_state": matrix},
                "usage": {"prompt_tokens": 4},
            }
            return self.answer("matrix", body, httpx.Response(200, json=answer))
        if kv.get("last_hidden_state_pooling") == "mean":
            fields: dict[str, Any] = {"last_hidden_state": b64([0.5] * HIDDEN)}
            return self.answer(
                "mean", body, httpx.Response(200, json={"kv_transfer_params": fields})
            )
        by_layer = {
            str(k): b64([float(k)] * HIDDEN) for k in kv.get("last_hidden_state_layers", [2])
        }
        fields = {
            "last_hidden_state": b64([2.0] * HIDDEN),
            "last_hidden_states_by_layer": by_layer,
        }
        return self.answer(
            "flagged", body, httpx.Response(200, json={"kv_transfer_params": fields})
        )


def run(proxy: ScriptedProxy, lines: list[str] | None = None) -> Deployment:
    client = httpx.Client(transport=httpx.MockTransport(proxy), base_url="http://proxy.test")
    return check(client, None, (lines if lines is not None else []).append)


def failure(proxy: ScriptedProxy) -> str:
    with pytest.raises(CheckFailed) as raised:
        run(proxy)
    return str(raised.value)


def test_a_healthy_deployment_passes_every_step() -> None:
    lines: list[str] = []
    proxy = ScriptedProxy()
    assert run(proxy, lines) == Deployment("tiny", LAYERS, 2, HIDDEN)
    assert proxy.seen == [
        "/health", "/version", "/metrics", "/v1/models", "/v1/hidden_states", "ordinary",
        "flagged", "mean", "stream", "matrix",
    ]  # fmt: skip
    assert "ok: vLLM 0.32.0" in lines
    assert "ok: engines publishing: 2; engines without a ring: 0" in lines
    assert "ok: engine 0 of vLLM instance 00000000000000ab: vLLM 0.33.0 V2 GPUModelRunner" in lines
    assert "ok: engine 1 of vLLM instance 00000000000000ab: runner not named" in lines
    assert f"ok: a flagged request: 3 layers of {HIDDEN} finite values each" in lines
    assert "ok: a matrix of 4 rows (every prompt position, through the arena)" in lines


def test_a_server_without_an_arena_skips_the_matrix_and_says_so() -> None:
    lines: list[str] = []
    proxy = ScriptedProxy(**{"/v1/hidden_states": lambda b: httpx.Response(200, json=capture(0))})
    run(proxy, lines)
    assert "matrix" not in proxy.seen
    assert "skipped: matrices (the hook runs with HIDDEN_STATE_PROXY_ARENA_MIB=0)" in lines


def test_a_matrix_of_the_wrong_shape_fails() -> None:
    def short(body: dict[str, Any]) -> httpx.Response:
        matrix = {"shape": [3, HIDDEN], "dtype": "float32", "data": b64([0.0] * 3 * HIDDEN)}
        answer = {
            "kv_transfer_params": {"last_hidden_state": matrix},
            "usage": {"prompt_tokens": 4},
        }
        return httpx.Response(200, json=answer)

    assert "shape [3, " in failure(ScriptedProxy(matrix=short))


def test_an_untested_vllm_is_said_to_be() -> None:
    lines: list[str] = []
    run(
        ScriptedProxy(**{"/version": lambda b: httpx.Response(200, json={"version": "0.40.1"})}),
        lines,
    )
    assert "ok: vLLM 0.40.1 (untested by this hook)" in lines


def test_health_503_is_the_fix_named_by_the_proxy() -> None:
    text = (
        "vLLM at http://x is healthy, but engine 1 ...: its worker hook could not start: no space"
    )
    message = failure(ScriptedProxy(**{"/health": lambda b: error(503, text)}))
    assert message == f"/health is 503: {text}"


def test_an_unreachable_proxy_names_the_url() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://proxy.test")
    with pytest.raises(CheckFailed, match=r"Cannot reach the proxy at http://proxy\.test"):
        check(client, None, print)


def test_an_api_key_is_asked_for() -> None:
    message = failure(ScriptedProxy(**{"/health": lambda b: error(401, "missing key")}))
    assert message == "The proxy asks for an API key: pass --api-key."


def test_a_hook_that_is_not_active_fails_with_the_proxys_fix() -> None:
    not_active = "The hidden-state worker hook is not active in the vLLM environment: install it"
    message = failure(ScriptedProxy(**{"/v1/hidden_states": lambda b: error(503, not_active)}))
    assert message == f"/v1/hidden_states is 503: {not_active}"


def test_a_proxy_without_the_capture_endpoint_names_the_release_fix() -> None:
    message = failure(ScriptedProxy(**{"/v1/hidden_states": lambda b: error(404, "Not Found")}))
    assert "older release" in message


def test_a_capture_description_without_its_layers_fails_clearly() -> None:
    broken = {k: v for k, v in capture().items() if k != "layers"}
    message = failure(
        ScriptedProxy(**{"/v1/hidden_states": lambda b: httpx.Response(200, json=broken)})
    )
    assert "'layers'" in message


def test_vectors_of_another_size_than_the_capture_says_fail() -> None:
    wrong = {**capture(), "hidden_size": HIDDEN * 2}
    message = failure(
        ScriptedProxy(**{"/v1/hidden_states": lambda b: httpx.Response(200, json=wrong)})
    )
    assert f"the hidden size is {HIDDEN * 2}" in message


def test_a_hook_that_never_publishes_fails() -> None:
    timeout = "The hidden state did not arrive within 30 s of vLLM's answer"
    message = failure(ScriptedProxy(flagged=lambda b: error(504, timeout)))
    assert message == f"A flagged request got 504: {timeout}"


def test_a_non_finite_vector_names_the_dtype_fix() -> None:
    def nan(body: dict[str, Any]) -> httpx.Response:
        by_layer = {str(k): b64([float("nan")] * HIDDEN) for k in LAYERS}
        return httpx.Response(
            200, json={"kv_transfer_params": {"last_hidden_states_by_layer": by_layer}}
        )

    message = failure(ScriptedProxy(flagged=nan))
    assert "has 8 non-finite values of 8" in message
    assert "--dtype bfloat16 or float32" in message


def test_a_stream_without_its_vector_fails() -> None:
    def bare(body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, text='data: {"choices": []}\n\ndata: [DONE]\n\n')

    assert "carried 0 vectors, not 1" in failure(ScriptedProxy(stream=bare))


def test_a_mean_of_another_size_fails() -> None:
    def short(body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"kv_transfer_params": {"last_hidden_state": b64([1.0])}})

    assert "mean-pooled vector has another size" in failure(ScriptedProxy(mean=short))


def test_an_ordinary_failure_is_vllms() -> None:
    message = failure(ScriptedProxy(ordinary=lambda b: error(500, "engine dead")))
    assert message == "An ordinary request got 500: engine dead"


def test_the_canary_passes_over_an_engine_the_proxy_already_names() -> None:
    def client(proxy: ScriptedProxy) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(proxy), base_url="http://proxy.test")

    assert canary(client(ScriptedProxy()), "tiny") is None
    note = (
        "The hidden state was not published: this request may have been served by an engine "
        "without a ring. engine 1"
    )
    assert canary(client(ScriptedProxy(flagged=lambda b: error(503, note))), "tiny") is None
    timeout = "The hidden state did not arrive within 30 s"
    assert canary(client(ScriptedProxy(flagged=lambda b: error(504, timeout))), "tiny") == (
        f"A flagged request got 504: {timeout}"
    )


def test_a_canary_without_an_answer_in_time_is_no_verdict() -> None:
    """A busy vLLM (traffic that came before the check) is not a broken hook: ``serve`` goes on."""

    def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            raise httpx.ReadTimeout("timed out", request=request)
        return ScriptedProxy()(request)

    client = httpx.Client(transport=httpx.MockTransport(slow), base_url="http://proxy.test")
    with pytest.raises(check_module.CheckUnanswered, match="did not answer /v1/completions"):
        canary(client, "tiny")


def test_the_command_exits_1_with_the_fix_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = ScriptedProxy(flagged=lambda b: error(504, "never published"))

    def scripted(url: str, api_key: str | None, timeout: float) -> httpx.Client:
        assert api_key == "k"
        return httpx.Client(transport=httpx.MockTransport(proxy), base_url=url)

    monkeypatch.setattr(check_module, "client_for", scripted)
    from vllm_hidden_state_proxy.cli import main

    assert main(["check", "--url", "http://proxy.test", "--api-key", "k"]) == 1
    assert capsys.readouterr().err == "FAILED: A flagged request got 504: never published\n"
