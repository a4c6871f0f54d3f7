"""Errors the proxy answers itself, in the OpenAI shape, and the factories that name the fix.

Shape: ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}``.
Errors coming from vLLM are never rewritten; these are only for decisions the proxy makes.

    ProxyError(status, message, param)
     ├── 400  bad_request(...)                   the client's request (names the field)
     │        no_token_generated(choice)         max_tokens 0: no answer state to return
     ├── 401  missing_api_key()                  missing or wrong API key (auth.py)
     ├── 408  body_timeout(seconds)              the body did not arrive in time
     ├── 413  body_too_large(limit)
     │        vectors_too_large(size, limit)     over --max-vectors-size
     │        all_answer_too_large(...)          max_tokens rows over the hook's max record
     ├── 502  the worker hook or vLLM did not give what the flag needs:
     │        hook_error(message)                the worker hook published an error record
     │        record_mismatch(...)               its record lacks a layer or pooling asked for
     │        answer_record_misplaced(...)       an answer's record of another position
     │        reply_too_large(limit)             vLLM's reply exceeds --max-answer-size
     │        not_a_json_object()                a 200 whose body is no JSON object
     │        reply_not_reencodable(exc)         a reply the vectors cannot be joined into
     │        chunk_not_reencodable(exc)         a streamed chunk likewise
     │        stream_held_too_long(missing, n)   a stream without its first choice in n bytes
     │        event_too_large(limit)             one streamed event over --max-answer-size
     │        stream_without_choice(error)       a stream that ended before its first choice
     │        stream_without_output(error)       a Responses stream that ended before output
     │        answer_not_counted(what)           a reply without a choice's token count
     │        chunk_without_count()              a choice's last chunk without its count
     │        completions_not_mergeable(exc)     a prompt list's replies not of vLLM's shape
     │        fan_out_incomplete()               cannot happen: a fanned-out request lost
     │        models_unreadable(...)             vLLM's /v1/models (its 401/403 kept)
     │        embedding_not_finite(where, field) NaN or infinity: no embedding
     │        vllm_unreachable(), exchange_failed(), stream_broke_off()
     │                                           (upstream.py maps transport errors to them)
     ├── 503  body_budget_exhausted()            request bodies buffered: at the total
     │        vectors_budget_exhausted(...)      vectors held: at --vectors-budget
     │        no_ring(ring_dir)                  no worker hook publishes in this directory
     │        ring_directory_refused(reason)     the ring directory fails its checks
     │        engines_without_ring(failures)     the engines whose hook could not start
     │        rings_of_other_models(shapes)      servers of different models share the directory
     │        no_arena(pooling)                  a matrix pooling on a hook without an arena
     │        default_layer_not_captured(...)    --embedding-layer not captured
     │        vllm_not_healthy(...), engines_not_ready(...)   /health
     ├── 504  vector_timeout(seconds)            vLLM replied, the vector never arrived
     │        vector_overwritten(slots)          its ring slot was reused before it was read
     │        vllm_timeout(), stream_stalled()   (upstream.py) vLLM did not send in time
     └── any  of_input(where, ...)               one embeddings input's failure, named
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from vllm_hidden_state_proxy.protocol import (
    API_KEY_ENV,
    ARENA_MIB_ENV,
    MAX_RECORD_MIB_ENV,
    RING_DIR_ENV,
    RING_SLOTS_ENV,
)
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


def reply_too_large(limit: int) -> ProxyError:
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


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


# -- the client's request ----------------------------------------------------------------------


def missing_api_key() -> ProxyError:
    return ProxyError(
        401,
        "Missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
        f"proxy was started with (--api-key / {API_KEY_ENV}).",
    )


def no_token_generated(choice: int) -> ProxyError:
    return ProxyError(
        400,
        f"Choice {choice} generated no token (max_tokens 0?), so there is no answer state "
        "to return: ask for at least one token.",
    )


def of_input(
    where: str, status: int, message: str, param: str | None, kind: str | None = None
) -> ProxyError:
    """One input's failure as its request's error, naming the input (``where``)."""
    return ProxyError(status, f"{where}: {message}", param, kind)


# -- the memory for vectors, and matrices ------------------------------------------------------


def vectors_too_large(size: int, limit: int, param: str | None = None) -> ProxyError:
    return ProxyError(
        413,
        f"The vectors of this request take {_mib(size)} in the proxy, more than one request may "
        f"({_mib(limit)}, the proxy's --max-vectors-size): ask for fewer prompts, rows, layers "
        "or choices.",
        param,
    )


def vectors_budget_exhausted(size: int, total: int) -> ProxyError:
    return ProxyError(
        503,
        f"The proxy's memory for vectors is in use ({_mib(total)}, --vectors-budget); "
        f"{_mib(size)} more does not fit now: retry.",
    )


def no_arena(pooling: str) -> ProxyError:
    return ProxyError(
        503,
        f"This vLLM server carries no matrices (pooling {pooling!r}): its worker hook runs "
        f"with {ARENA_MIB_ENV}=0. Restart it with an arena.",
    )


def all_answer_too_large(
    rows: int, layers: int, hidden_size: int, size: int, limit: int, param: str
) -> ProxyError:
    return ProxyError(
        413,
        f"An all_answer matrix of up to {rows} rows x {layers} layers "
        f"x {hidden_size} float32 takes {size / (1 << 20):.1f} MiB, more than one "
        f"request may ({MAX_RECORD_MIB_ENV}={limit >> 20} in vLLM's environment): ask for "
        f"fewer tokens or layers.",
        param,
    )


# -- vLLM's reply ------------------------------------------------------------------------------


def vllm_timeout() -> ProxyError:
    return ProxyError(504, "vLLM did not answer in time.")


def vllm_unreachable() -> ProxyError:
    return ProxyError(502, "Could not reach vLLM (the proxy's log says why).")


def exchange_failed() -> ProxyError:
    return ProxyError(
        502, "The exchange with vLLM failed before it answered (the proxy's log says why)."
    )


def stream_stalled() -> ProxyError:
    return ProxyError(504, "vLLM stopped sending its stream (the read timeout passed).")


def stream_broke_off() -> ProxyError:
    return ProxyError(502, "vLLM's stream broke off before its end (the proxy's log says why).")


def not_a_json_object() -> ProxyError:
    return ProxyError(502, "vLLM answered 200 with a body that is not a JSON object.")


def reply_not_reencodable(exc: Exception) -> ProxyError:
    return ProxyError(502, f"vLLM's answer cannot be re-encoded with the vector: {exc}")


def chunk_not_reencodable(exc: Exception) -> ProxyError:
    return ProxyError(502, f"vLLM streamed a chunk the proxy cannot re-encode: {exc}.")


def stream_held_too_long(missing: str, limit: int) -> ProxyError:
    return ProxyError(
        502,
        f"vLLM's stream had {missing} in its first {limit} bytes (the proxy's --max-answer-size).",
    )


def event_too_large(limit: int) -> ProxyError:
    return ProxyError(
        502,
        f"vLLM streamed an event larger than {limit} bytes (the proxy's --max-answer-size).",
    )


def stream_without_choice(error: bytes | None) -> ProxyError:
    said = "" if error is None else f" vLLM's error: {error.decode(errors='replace')}"
    return ProxyError(
        502,
        f"vLLM's stream ended before its first choice, which the hidden state rides on.{said}",
    )


def stream_without_output(event: bytes | None) -> ProxyError:
    said = "" if event is None else f" vLLM's event: {event.decode(errors='replace')}"
    return ProxyError(
        502, f"vLLM's stream ended before any output, so without the hidden state.{said}"
    )


def answer_not_counted(what: str) -> ProxyError:
    return ProxyError(
        502,
        f"vLLM's answer {what}, which the proxy needs to find the answer's hidden state "
        "(is this vLLM's OpenAI server, 0.32 or later?).",
    )


def chunk_without_count() -> ProxyError:
    return ProxyError(
        502,
        "vLLM streamed a choice's last chunk without its own token count (one choice per "
        "chunk, with continuous usage stats), which the proxy needs to find the answer's "
        "hidden state.",
    )


def answer_record_misplaced(
    choice: int,
    position: int,
    rows: int,
    record_prompt_tokens: int,
    output_tokens: int,
    reply_prompt_tokens: int | None,
    expected: int,
) -> ProxyError:
    """An answer's record that does not fit the reply's count (``reply_prompt_tokens``: the
    prompt's length where the reply says it and it differs)."""
    return ProxyError(
        502,
        f"The vLLM worker hook's answer record of choice {choice} is of position "
        f"{position} ({rows} rows) of a {record_prompt_tokens}-token "
        f"prompt, but vLLM's answer has {output_tokens} tokens"
        + (
            f" after a {reply_prompt_tokens}-token prompt"
            if reply_prompt_tokens is not None
            else ""
        )
        + f" (position {expected}): the worker hook and this proxy disagree; please report "
        "it.",
    )


def completions_not_mergeable(exc: Exception) -> ProxyError:
    return ProxyError(502, f"vLLM's completions answers cannot be merged: {exc}")


def list_record_mismatch(index: int, published: int, sent: int) -> ProxyError:
    return ProxyError(
        502,
        f"The vLLM worker hook published a record of {published} prompt tokens for prompt "
        f"{index} of the list, which has {sent}: not this prompt's vector, so none is sent.",
    )


def alone_failed(index: int, status: int, content: bytes) -> ProxyError:
    """vLLM refused prompt ``index`` of a list sent again alone for its mean (it had taken the
    same prompt in the list)."""
    text = content[:300].decode("utf-8", "replace")
    return ProxyError(
        502,
        f"Prompt {index} of the list was served part of its positions from the prefix cache and "
        f"sent again alone for its mean; vLLM answered that request {status}: {text}",
    )


def fan_out_incomplete() -> ProxyError:
    return ProxyError(502, "a fanned-out request did not complete")


def models_unreadable(exc: Exception | None = None, status: int | None = None) -> ProxyError:
    """vLLM's ``/v1/models`` could not be read (``exc``), answered ``status`` (its 401 or 403
    is the client's key, kept), or has no list of models (neither)."""
    if exc is not None:
        return ProxyError(502, f"vLLM's /v1/models could not be read: {exc!r}")
    if status is not None:
        return ProxyError(
            status if status in (401, 403) else 502, f"vLLM's /v1/models answered {status}."
        )
    return ProxyError(502, "vLLM's /v1/models answer has no list of models.")


def embedding_not_finite(where: str, field: str) -> ProxyError:
    return ProxyError(
        502,
        f"{where}: the model's hidden state holds NaN or infinity (an overflow, "
        "e.g. in float16), so it is no embedding.",
        field,
    )


# -- the server's own state ----------------------------------------------------------------------


def default_layer_not_captured(refusal: ProxyError) -> ProxyError:
    """The server's ``--embedding-layer`` is not captured by its vLLM: the operator's mistake,
    not the client's."""
    return ProxyError(
        503,
        f"This server's default embedding layer (--embedding-layer) is not captured by its vLLM: "
        f"{refusal.message} Or send 'layer' with one of those.",
    )


def vllm_not_healthy(vllm: str, problem: str) -> ProxyError:
    """``vllm``: "vLLM", or with its address for a request that carries the API key."""
    return ProxyError(503, f"{vllm} is not healthy: {problem}.")


def engines_not_ready(vllm: str, why: str) -> ProxyError:
    return ProxyError(503, f"{vllm} is healthy, but {why}.")
