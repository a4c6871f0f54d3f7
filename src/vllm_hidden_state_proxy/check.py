"""``hidden-state-proxy check --url URL``: prove a deployment's path end to end, or name the fix.

Run against any proxy (``serve``, compose, a Helm pod). In order, each step printed as one
line:

1. ``/health`` (the proxy's: vLLM's, and every engine's hook, from the rings and the failure
   notes), ``/version`` (vLLM's) and ``/metrics`` (live rings, engines without one);
2. what the server captures (``GET /v1/hidden_states``: the model, hidden size, layers,
   poolings and limits, read by ``client.read_capture``);
3. an ordinary request, then flagged ones: every captured layer at the last position, the
   final layer's mean, and a streamed one; each vector must have the same size and be finite;
4. a matrix (pooling ``"all_prompt"``, through the ring's arena): one finite row per prompt
   token (skipped, and said so, on a server whose hook runs without an arena).

It stops at the first failure and exits 1 with one sentence that names the fix (mostly the
proxy's own error text, which is written to name it); 0 if all passed. Each publishing
engine's vLLM version and model runner (V1/V2 and its class) come from its ring's header, which
the proxy's ``/metrics`` shows as ``hidden_state_proxy_ring_info``; an engine whose hook refused
its runner names it in its failure note.

``serve`` runs :func:`canary` (an ordinary and a flagged request) once its proxy is up, so a
hook that wraps vLLM but never publishes fails the start instead of the first user's request.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from vllm_hidden_state_proxy.client import (
    Array,
    Capture,
    HiddenStateDecodeError,
    HiddenStateServerError,
    HiddenStateStream,
    decode_values,
    hidden_state_fields,
    read_capture,
)
from vllm_hidden_state_proxy.protocol import ARENA_MIB_ENV, CAPTURE_PATH, KV
from vllm_hidden_state_proxy.transport.ops import (
    HEALTH_PATH,
    METRICS_PATH,
    MODELS_PATH,
    VERSION_PATH,
)
from vllm_hidden_state_proxy.worker_hook.compat import describe_vllm

PROMPT = "The hidden-state proxy check: a short prompt."


class CheckFailed(Exception):
    """A step failed; the message is the one sentence that names the fix."""


class CheckUnanswered(CheckFailed):
    """A request got no answer within the client's timeout: the proxy or vLLM is busy or hung,
    which the check cannot tell apart."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """What the check learned."""

    model: str
    layers: tuple[int, ...]
    num_hidden_layers: int
    hidden_size: int


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or f"HTTP {response.status_code}"


def _vector(value: Any, where: str) -> Array:
    if not isinstance(value, (str, dict)):
        raise CheckFailed(
            f"{where} is not the base64 vector asked for ({type(value).__name__}): the proxy is "
            "not vllm-hidden-state-proxy, or of another release than this command; install one "
            "release for both."
        )
    try:
        vector = decode_values(value, "float32", where)
    except HiddenStateDecodeError as error:
        raise CheckFailed(f"{error} Install one release for the proxy and the hook.") from None
    return _finite(vector, where)


def _finite(vector: Array, where: str) -> Array:
    if not vector.size:
        raise CheckFailed(f"{where} is empty: reinstall one release of the package for both sides.")
    if not np.isfinite(vector).all():
        bad = int((~np.isfinite(vector)).sum())
        raise CheckFailed(
            f"{where} has {bad} non-finite values of {vector.size}: the model overflows in its "
            "dtype; serve it with --dtype bfloat16 or float32."
        )
    return vector


class _Probe:
    def __init__(self, client: httpx.Client, say: Callable[[str], None]) -> None:
        self.client = client
        self.say = say

    def get(self, path: str) -> httpx.Response:
        try:
            response = self.client.get(path)
        except httpx.HTTPError as error:
            raise CheckFailed(
                f"Cannot reach the proxy at {self.client.base_url} ({error!r}): start it "
                "(hidden-state-proxy serve or proxy) or correct --url."
            ) from None
        if response.status_code == 401:
            raise CheckFailed("The proxy asks for an API key: pass --api-key.")
        return response

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return self.client.post(path, json=body)
        except httpx.TimeoutException as error:
            raise CheckUnanswered(
                f"The proxy did not answer {path} in time ({error!r}): vLLM may be busy or hung; "
                "see the proxy's and vLLM's logs."
            ) from None
        except httpx.HTTPError as error:
            raise CheckFailed(
                f"The proxy broke off {path} ({error!r}): see the proxy's and vLLM's logs."
            ) from None

    def completion(self, model: str, kv: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        """``kv``: :func:`hidden_state_fields`' arguments of a flagged request; ``None``: an
        ordinary one."""
        body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 1, **extra}
        if kv is not None:
            body.update(hidden_state_fields(**kv))
        response = self.post("/v1/completions", body)
        if response.status_code != 200:
            what = "A flagged request" if kv is not None else "An ordinary request"
            raise CheckFailed(f"{what} got {response.status_code}: {_error_text(response)}")
        answer: dict[str, Any] = response.json()
        return answer

    def stream(self, model: str) -> Iterator[dict[str, Any]]:
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 2,
            "stream": True,
            **hidden_state_fields(),
        }
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise CheckFailed(
                        f"A streamed flagged request got {response.status_code}: "
                        f"{_error_text(response)}"
                    )
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[len("data: ") :])
        except httpx.HTTPError as error:
            raise CheckFailed(f"The proxy broke off a streamed request ({error!r}).") from None


def _metric(text: str, name: str) -> int | None:
    match = re.search(rf"^hidden_state_proxy_{name} (\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


_RING_INFO = re.compile(
    r'^hidden_state_proxy_ring_info\{instance="([0-9a-f]+)",engine="(\d+)",runner="([^"]*)"\} 1',
    re.MULTILINE,
)


def runners(metrics_text: str) -> list[str]:
    """One line per live ring in ``/metrics``: its engine and what its hook wraps."""
    return [
        f"engine {engine} of vLLM instance {instance}: {runner or 'runner not named'}"
        for instance, engine, runner in _RING_INFO.findall(metrics_text)
    ]


def _overview(probe: _Probe, model: str | None) -> str:
    health = probe.get(HEALTH_PATH)
    if health.status_code != 200:
        raise CheckFailed(f"/health is {health.status_code}: {_error_text(health)}")
    probe.say("ok: /health is 200 (vLLM healthy, no engine reports a hook failure)")
    version = probe.get(VERSION_PATH)
    if version.status_code == 200:
        probe.say(f"ok: {describe_vllm(str(version.json().get('version')))}")
    metrics = probe.get(METRICS_PATH)
    if metrics.status_code == 200:
        rings = _metric(metrics.text, "live_rings")
        without = _metric(metrics.text, "engines_without_ring")
        probe.say(f"ok: engines publishing: {rings}; engines without a ring: {without}")
        for line in runners(metrics.text):
            probe.say(f"ok: {line}")
    if model is not None:
        return model
    models = probe.get(MODELS_PATH)
    if models.status_code != 200 or not models.json().get("data"):
        raise CheckFailed(f"/v1/models gave no model ({models.status_code}): pass --model.")
    return str(models.json()["data"][0]["id"])


def _captured(probe: _Probe) -> Capture:
    response = probe.get(CAPTURE_PATH)
    try:
        return read_capture(response)
    except HiddenStateServerError as error:
        if error.status == 404:
            raise CheckFailed(
                f"{CAPTURE_PATH} is 404: the proxy is of an older release than this command; "
                "install one release of vllm-hidden-state-proxy for the proxy and this command."
            ) from None
        raise CheckFailed(f"{CAPTURE_PATH} is {error.status}: {error.message}") from None
    except HiddenStateDecodeError as error:
        raise CheckFailed(str(error)) from None


def check(client: httpx.Client, model: str | None, say: Callable[[str], None]) -> Deployment:
    """Every step, in order; raises :class:`CheckFailed` at the first failure."""
    probe = _Probe(client, say)
    model = _overview(probe, model)
    capture = _captured(probe)
    layers, final = capture.layers, capture.num_hidden_layers
    say(
        f"ok: model {model!r}, {final} decoder layers; captured layers {layers}; hidden size "
        f"{capture.hidden_size}; poolings {', '.join(capture.poolings)}"
    )
    probe.completion(model, None)
    say("ok: an ordinary request is answered")
    answer = probe.completion(model, {"layers": list(layers)})
    by_layer = answer.get(KV, {}).get("last_hidden_states_by_layer")
    if not isinstance(by_layer, dict) or sorted(map(int, by_layer)) != sorted(layers):
        raise CheckFailed(
            f"A flagged request came back without the vectors of layers {layers} ({KV} holds "
            f"{sorted(answer.get(KV) or {})}): install one release for the proxy and the hook."
        )
    sizes = {_vector(value, f"layer {key}'s vector").size for key, value in by_layer.items()}
    if len(sizes) != 1:
        raise CheckFailed(f"The layers' vectors differ in size ({sorted(sizes)}): a hook bug.")
    [hidden_size] = sizes
    if hidden_size != capture.hidden_size:
        raise CheckFailed(
            f"The vectors have {hidden_size} values, but {CAPTURE_PATH} says the hidden size is "
            f"{capture.hidden_size}: install one release for the proxy and the hook."
        )
    say(f"ok: a flagged request: {len(layers)} layers of {hidden_size} finite values each")
    mean = probe.completion(model, {"pooling": "mean"})
    if _vector(mean.get(KV, {}).get("last_hidden_state"), "the mean").size != hidden_size:
        raise CheckFailed("The mean-pooled vector has another size than the last-position one.")
    say("ok: a mean-pooled flagged request")
    reader = HiddenStateStream()
    try:
        carried = sum(reader.feed(chunk) is not None for chunk in probe.stream(model))
    except (HiddenStateServerError, HiddenStateDecodeError) as error:
        raise CheckFailed(f"A streamed flagged request failed: {error}") from None
    if carried != 1:
        raise CheckFailed(
            f"A streamed flagged request carried {carried} vectors, not 1: put nothing "
            "between the client and the proxy that rewrites server-sent events."
        )
    streamed = reader.result().vector
    if streamed is None or _finite(streamed, "the streamed vector").size != hidden_size:
        raise CheckFailed("The streamed vector has another size than the unstreamed one.")
    say("ok: a streamed flagged request")
    if "all_prompt" in capture.poolings:
        _check_matrix(probe, model, hidden_size)
    else:
        say(f"skipped: matrices (the hook runs with {ARENA_MIB_ENV}=0)")
    return Deployment(model, layers, final, hidden_size)


def _check_matrix(probe: _Probe, model: str, hidden_size: int) -> None:
    """An ``"all_prompt"`` matrix: one row per prompt token, each of ``hidden_size``."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1,
        **hidden_state_fields(pooling="all_prompt"),
    }
    response = probe.post("/v1/completions", body)
    if response.status_code != 200:
        raise CheckFailed(f"A matrix request got {response.status_code}: {_error_text(response)}")
    answer = response.json()
    matrix = answer.get(KV, {}).get("last_hidden_state")
    tokens = (answer.get("usage") or {}).get("prompt_tokens")
    shape = matrix.get("shape") if isinstance(matrix, dict) else None
    if shape != [tokens, hidden_size]:
        raise CheckFailed(
            f"A matrix request came back with shape {shape}, not [{tokens}, {hidden_size}] "
            "(prompt tokens x hidden size): install one release for the proxy and the hook."
        )
    rows = _vector(matrix, "the matrix").shape[0]
    probe.say(f"ok: a matrix of {rows} rows (every prompt position, through the arena)")


def canary(client: httpx.Client, model: str | None = None) -> str | None:
    """An ordinary and a flagged request (``serve``'s startup check); the problem or ``None``.

    A 503 naming an engine without a ring is not a problem here: ``/health`` reports those,
    and ``serve`` keeps serving the other engines and ordinary traffic. Raises
    :class:`CheckUnanswered` when a request got no answer in the client's timeout (traffic sent
    as soon as the proxy's ``/health`` answered can keep vLLM busy past it): no verdict.
    """
    probe = _Probe(client, lambda line: None)
    try:
        if model is None:
            models = probe.get(MODELS_PATH)
            data = models.json().get("data") if models.status_code == 200 else None
            if not data:
                return f"/v1/models answered {models.status_code} without a model"
            model = str(data[0]["id"])
        probe.completion(model, None)
        probe.completion(model, {})
    except CheckUnanswered:
        raise
    except CheckFailed as failed:
        if "engine without a ring" in str(failed):
            return None
        return str(failed)
    except ValueError as error:  # not JSON: whatever answers is not this proxy
        return f"the proxy's answer was not JSON ({error})"
    return None


def client_for(url: str, api_key: str | None, timeout: float) -> httpx.Client:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)


def run_check(url: str, api_key: str | None, model: str | None, timeout: float) -> int:
    """The ``check`` command: 0 when every step passed, 1 with the fix on stderr otherwise."""
    with client_for(url, api_key, timeout) as client:
        try:
            check(client, model, lambda line: print(line, flush=True))
        except CheckFailed as failed:
            print(f"FAILED: {failed}", file=sys.stderr, flush=True)
            return 1
    print(f"passed: {url} returns hidden states", flush=True)
    return 0
