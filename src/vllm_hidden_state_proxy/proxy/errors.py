"""Errors the proxy answers itself, in the OpenAI shape, and the factories that name the fix.

Shape: ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}``.
Errors coming from vLLM are never rewritten; these are only for decisions the proxy makes.

    ProxyError(status, message, param)
     ├── 400  bad_request(...)                   the client's request (names the field)
     ├── 408  body_timeout(seconds)              the body did not arrive in time
     ├── 413  body_too_large(limit)
     ├── 401  (auth.py)                          missing or wrong API key
     ├── 502  hook_error(message)                the worker hook published an error record
     │        answer_too_large(limit)            vLLM's answer exceeds --max-answer-size
     │        record_mismatch(...)               its record lacks a layer or pooling asked for
     │        (upstream.py) vLLM unreachable, or broke off the exchange
     ├── 503  body_budget_exhausted()            request bodies buffered: at the total
     │        no_ring(ring_dir)                  no worker hook publishes in this directory
     │        ring_directory_refused(reason)     the ring directory fails its checks
     │        engines_without_ring(failures)     the engines whose hook could not start
     │        rings_of_other_models(shapes)      servers of different models share the directory
     └── 504  vector_timeout(seconds)            vLLM answered, the vector never arrived
              vector_overwritten(slots)          its ring slot was reused before it was read
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from vllm_hidden_state_proxy.protocol import RING_DIR_ENV, RING_SLOTS_ENV
from vllm_hidden_state_proxy.ring import EngineFailure, RingShape

#: Error ``type`` per HTTP status for the statuses the proxy produces.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    408: "request_timeout",
    413: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class ProxyError(Exception):
    """A request the proxy answers itself, with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(status, message, param)
        self.status = status
        self.message = message
        self.param = param
        #: The error ``type``; by default the status's (vLLM's own, for an error it sent).
        self.kind = kind or _TYPES.get(status, "proxy_error")

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param)


def body_too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"Request body exceeds the proxy's limit of {limit} bytes.")


def answer_too_large(limit: int) -> ProxyError:
    return ProxyError(
        502,
        f"vLLM's answer to this flagged request is larger than the proxy holds in memory "
        f"({limit} bytes, --max-answer-size): ask for less (fewer choices or tokens, no echo or "
        "logprobs), or raise the limit.",
    )


def body_timeout(seconds: float) -> ProxyError:
    return ProxyError(
        408, f"The request body did not arrive within the proxy's {seconds:g} s (--body-timeout)."
    )


def body_budget_exhausted() -> ProxyError:
    return ProxyError(
        503,
        "The proxy is buffering as many request-body bytes as it may (--body-budget); retry "
        "shortly.",
    )


def no_ring(ring_dir: str) -> ProxyError:
    return ProxyError(
        503,
        "The hidden-state worker hook is not active in the vLLM environment: install "
        "vllm-hidden-state-proxy into vLLM's Python environment (it registers a "
        "`vllm.general_plugins` entry point), make sure VLLM_PLUGINS (if set) includes "
        f"`hidden_state_hook`, and that vLLM and the proxy use the same ring directory "
        f"({ring_dir}) on shared memory.",
    )


def ring_directory_refused(reason: str) -> ProxyError:
    return ProxyError(
        503,
        f"The hidden state cannot be read: {reason}. The proxy reads no ring there until that "
        "is fixed (vLLM's worker hook refuses the directory too).",
    )


def engines_without_ring(failures: Sequence[EngineFailure]) -> ProxyError:
    described = "; ".join(failure.describe() for failure in failures)
    return ProxyError(
        503,
        f"The hidden state was not published: this request may have been served by an engine "
        f"without a ring. {described}. Fix the cause and restart vLLM (vLLM's log has details).",
    )


def rings_of_other_models(shapes: Sequence[RingShape], ring_dir: str) -> ProxyError:
    models = sorted({shape.model_dims for shape in shapes})
    described = "; ".join(
        f"hidden size {size}, {n} decoder layer{'' if n == 1 else 's'}" for size, n in models
    )
    return ProxyError(
        503,
        f"The ring directory {ring_dir} holds the rings of vLLM servers of different models "
        f"({described}): this proxy cannot tell which are its vLLM's. Give each vLLM server "
        f"its own ring directory ({RING_DIR_ENV}; serve --ring-dir).",
    )


def hook_error(message: str, status: int = 502) -> ProxyError:
    """The hook's error record: 502 it failed, 413 a limit of one request, 503 of the engine."""
    return ProxyError(status, f"The vLLM worker hook could not produce the hidden state: {message}")


def record_mismatch(
    published: Sequence[int], published_pooling: str, wanted: Sequence[int], wanted_pooling: str
) -> ProxyError:
    def listed(layers: Sequence[int]) -> str:
        return ", ".join(map(str, layers))

    return ProxyError(
        502,
        f"The vLLM worker hook published layers {listed(published)} ({published_pooling} "
        f"pooling) for this request, which asked for layers {listed(wanted)} ({wanted_pooling} "
        "pooling): the worker hook in vLLM and this proxy come from different releases of "
        "vllm-hidden-state-proxy.",
    )


def vector_timeout(seconds: float) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state did not arrive within {seconds:g} s of vLLM's answer: it was not "
        "published by the vLLM worker hook.",
    )


def vector_overwritten(slots: int | None) -> ProxyError:
    return ProxyError(
        504,
        f"The hidden state was overwritten in the shared-memory ring ({slots} slots) before the "
        "proxy read it: more flagged prompts were prefilled meanwhile than the ring holds. "
        f"Retry, or raise {RING_SLOTS_ENV} in vLLM's environment.",
    )
