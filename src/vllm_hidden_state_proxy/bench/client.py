"""Request bodies and timed HTTP calls (httpx, async). Latency is client-side: ``perf_counter``
from just before the request is sent until its whole response body has arrived; bodies are
serialised before the clock starts and parsed after it stops."""

from __future__ import annotations

import base64
import itertools
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson

from vllm_hidden_state_proxy.proxy.embeddings_plan import DEFAULT_TEMPLATE, PLACEHOLDER

CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
Flag = Literal["float", "base64"] | None
#: Chat template options sent with every request (and with the pooling server's requests, so
#: that both render the very same prompt).
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
REQUEST_TIMEOUT = 300.0
#: Seconds an idle keep-alive connection is kept. The servers (uvicorn: vLLM and the proxy)
#: close idle connections after 5 s; a request sent just as they do fails (a read error).
#: While the other arms take their turn a connection can idle that long: retire it first.
KEEPALIVE_EXPIRY = 2.0
#: Two token events closer than this came in one burst (one read), not one by one.
BURST_GAP = 1e-4


class BenchError(RuntimeError):
    """A server answered something the benchmark cannot measure; the run stops."""


def prompt_messages(index: int) -> list[dict[str, str]]:
    """The chat of request ``index``: one user message, different for every index (so no two
    requests share a whole prompt) with a long common prefix (as real traffic has)."""
    return [
        {
            "role": "user",
            "content": f"Summarize this text in one word (request {index}): "
            "A yellow bicycle beside a stone wall, in the morning light.",
        }
    ]


def chat_body(
    model: str,
    index: int,
    *,
    flag: Flag = None,
    max_tokens: int = 1,
    stream: bool = False,
) -> bytes:
    """A chat request: ``max_tokens`` tokens, ``ignore_eos`` so that exactly that many come."""
    document: dict[str, Any] = {
        "model": model,
        "messages": prompt_messages(index),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
    }
    if stream:
        document["stream"] = True
        document["stream_options"] = {"include_usage": True}
        document["return_token_ids"] = True  # to count tokens, also when events merge them
    if flag is not None:
        kv: dict[str, Any] = {"return_last_hidden_state": True}
        if flag == "base64":
            kv["last_hidden_state_format"] = "base64"
        document["kv_transfer_params"] = kv
    return orjson.dumps(document)


def embeddings_body(model: str, index: int) -> bytes:
    """The pooling server's request for the prompt chat request ``index`` renders."""
    return orjson.dumps(
        {
            "model": model,
            "messages": prompt_messages(index),
            "add_generation_prompt": True,
            "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
            "use_activation": False,
            "encoding_format": "float",
        }
    )


def embedding_text(index: int) -> str:
    """Input ``index`` of the embeddings phase: a short text, different for every index."""
    return f"Passage {index}: a yellow bicycle leans on a stone wall in the morning light."


def embedding_inputs_body(model: str, first_index: int, batch: int) -> bytes:
    """A ``/v1/embeddings`` request to the proxy: ``batch`` distinct texts, float vectors."""
    texts = [embedding_text(first_index + offset) for offset in range(batch)]
    return orjson.dumps({"model": model, "input": texts, "encoding_format": "float"})


def embedding_chat_body(model: str, index: int, template: str = DEFAULT_TEMPLATE) -> bytes:
    """The one-token chat the proxy sends vLLM for input ``index`` (with the proxy's default
    template), unflagged: what vLLM alone does for that input."""
    content = template.replace(PLACEHOLDER, embedding_text(index))
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": 1,
            "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
        }
    )


def new_client(
    base_url: str,
    connections: int,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A client whose pool holds ``connections`` keep-alive connections (one per worker);
    with ``api_key`` every request carries ``Authorization: Bearer <api_key>``. ``transport``
    replaces the network (tests)."""
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return httpx.AsyncClient(
        base_url=base_url,
        limits=httpx.Limits(
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=KEEPALIVE_EXPIRY,
        ),
        timeout=httpx.Timeout(REQUEST_TIMEOUT),
        trust_env=False,  # loopback only: never through an HTTP proxy from the environment
        headers=headers,
        transport=transport,
    )


@dataclass(frozen=True)
class Timed:
    seconds: float
    status: int
    body: bytes

    def json(self) -> dict[str, Any]:
        document = orjson.loads(self.body)
        if not isinstance(document, dict):
            raise BenchError(f"expected a JSON object, got {self.body[:200]!r}")
        return document

    def require_ok(self, what: str) -> Timed:
        if self.status != 200:
            text = self.body[:500].decode(errors="replace")
            raise BenchError(f"{what}: HTTP {self.status}: {text}")
        return self


async def timed_post(client: httpx.AsyncClient, path: str, body: bytes) -> Timed:
    start = time.perf_counter()
    try:
        response = await client.post(path, content=body)
    except httpx.TransportError as error:
        raise BenchError(f"POST {client.base_url}{path}: {type(error).__name__}: {error}") from None
    seconds = time.perf_counter() - start
    return Timed(seconds, response.status_code, response.content)


def floats_from_bytes(raw: bytes) -> list[float]:
    values = array("f")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def returned_vector(completion: dict[str, Any]) -> list[float] | str | None:
    """``kv_transfer_params.last_hidden_state`` as returned (float list or base64 text)."""
    kv = completion.get("kv_transfer_params")
    if not isinstance(kv, dict):
        return None
    vector = kv.get("last_hidden_state")
    if isinstance(vector, list) and all(isinstance(x, (int, float)) for x in vector):
        return [float(x) for x in vector]
    if isinstance(vector, str):
        return vector
    return None


def decode_base64_vector(text: str) -> list[float]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise BenchError(f"base64 vector of {len(raw)} bytes is not whole float32 values")
    return floats_from_bytes(raw)


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: seconds to the first token, between consecutive tokens, and to
    the last token."""

    ttft: float
    gaps: list[float]
    tokens: int
    total: float

    @property
    def burst(self) -> bool:
        """True if the tokens came (nearly) all at once rather than one by one: at least 90%
        of the gaps under ``BURST_GAP`` seconds (the server sent them back to back)."""
        short = sum(1 for gap in self.gaps if gap < BURST_GAP)
        return short >= 0.9 * len(self.gaps)


def tokens_in_event(data: bytes) -> int:
    """How many generated tokens an SSE event carries: the length of its first choice's
    ``token_ids`` (asked for with ``return_token_ids``; vLLM merges several tokens into one
    event when its consumer falls behind), else 1 for a content delta. The opening ``role``
    announcement and the closing usage event (no choices) carry none."""
    chunk = orjson.loads(data)
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return 0
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    delta = choice.get("delta") or {}
    return 0 if "role" in delta else 1


async def timed_stream(client: httpx.AsyncClient, body: bytes, expected: int) -> StreamTiming:
    """Stream a chat request and time each token event as it arrives."""
    arrivals: list[float] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", CHAT_PATH, content=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:500].decode(errors="replace")
                raise BenchError(f"streaming request: HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                # Tokens that came in one event came at once: each gets the event's arrival.
                arrivals.extend([now] * tokens_in_event(line[6:].encode()))
    except httpx.TransportError as error:
        raise BenchError(
            f"streaming from {client.base_url}: {type(error).__name__}: {error}"
        ) from None
    if len(arrivals) != expected:
        raise BenchError(f"streaming request: {len(arrivals)} tokens, expected {expected}")
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return StreamTiming(
        ttft=arrivals[0] - start, gaps=gaps, tokens=len(arrivals), total=arrivals[-1] - start
    )
