"""Request bodies and timed HTTP calls (httpx, async). Latency is client-side: ``perf_counter``
from just before the request is sent until its whole response body has arrived; bodies are
serialised before the clock starts and parsed after it stops."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from vllm_hidden_state_proxy.protocol import (
    CHAT_PATH,
    FLAG,
    FORMAT,
    KV,
    POOLING,
    REQUEST_KEY_ENTRY,
    SPANS,
    VECTOR,
    XARGS,
    new_request_key,
    request_key_to_wire,
)

Flag = Literal["float", "base64"] | None
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
REQUEST_TIMEOUT = 300.0
#: Seconds an idle keep-alive connection is kept. The servers (uvicorn: vLLM and the proxy)
#: close idle connections after 5 s; a request sent just as they do fails (a read error).
#: While the other arms take their turn a connection can idle that long: retire it first.
KEEPALIVE_EXPIRY = 2.0
#: In every flagged answer; a byte search for it keeps the client's work equal for every arm.
VECTOR_MARKER = f'"{VECTOR}"'.encode()
#: The spans of a bench chat's prompt that a ``"spans"`` route asks for (its prompt is longer).
BENCH_SPANS = [[0, 8], [8, 16], [16, 24], [0, 24]]

#: Sends one request and checks its answer; returns its seconds (``BenchError`` on a bad one).
Request = Callable[[], Awaitable[float]]


class BenchError(RuntimeError):
    """A server answered something the benchmark cannot measure; the run stops."""


@dataclass(frozen=True)
class Route:
    """Where an arm sends its requests, and with which flag."""

    name: str
    description: str
    base_url: str
    flag: Flag = None
    #: The key of the server this route goes to (the proxy's, or vLLM's own).
    api_key: str | None = field(default=None, repr=False)
    #: ``last_hidden_state_pooling`` of a flagged route.
    pooling: str = "last"
    #: Straight to vLLM with a request key of its own in ``vllm_xargs``: the worker hook
    #: captures and publishes the vector, and nobody reads it (what the hook costs in vLLM).
    hooked: bool = False


@dataclass(frozen=True)
class ChatStack:
    """What the chat arms measure: a proxy, the vLLM behind it, the model it serves."""

    proxy_url: str
    vllm_url: str
    model: str
    #: Sent to the proxy only.
    api_key: str | None = field(default=None, repr=False)
    #: Replaces the network (tests).
    transport: httpx.AsyncBaseTransport | None = None
    #: The ``serve`` process, when the bench started the stack itself.
    pid: int | None = None
    #: vLLM's own key, sent by the direct routes only (serve starts vLLM with one).
    vllm_api_key: str | None = field(default=None, repr=False)
    #: CPU seconds of the proxy's and of vLLM's process trees so far (None: not on this host).
    proxy_cpu: Callable[[], float] | None = None
    vllm_cpu: Callable[[], float] | None = None

    def client(self, route: Route, connections: int = 1) -> httpx.AsyncClient:
        return new_client(route.base_url, connections, route.api_key, self.transport)

    def direct(self, name: str, description: str, hooked: bool = False) -> Route:
        return Route(name, description, self.vllm_url, api_key=self.vllm_api_key, hooked=hooked)

    def via_proxy(
        self, name: str, description: str, flag: Flag = None, pooling: str = "last"
    ) -> Route:
        return Route(name, description, self.proxy_url, flag, self.api_key, pooling)

    def chat_body(self, route: Route, index: int, max_tokens: int = 1) -> bytes:
        """Chat ``index`` of ``route`` (its flag and pooling)."""
        return chat_body(
            self.model,
            index,
            flag=route.flag,
            max_tokens=max_tokens,
            pooling=route.pooling,
            hooked=route.hooked,
        )

    def chat_request(
        self, client: httpx.AsyncClient, route: Route, indices: Iterator[int], max_tokens: int = 1
    ) -> Request:
        """The route's chats on ``client``, request ``next(indices)`` each."""
        bodies = (self.chat_body(route, i, max_tokens) for i in indices)
        return chat_request(client, route.name, bodies, route.flag is not None)


def prompt_messages(index: int) -> list[dict[str, str]]:
    """The chat of request ``index``: different for every index (no arm profits from another's
    prefix-cache entry), with a long common prefix (as real traffic has)."""
    content = f"Summarize this text in one word (request {index}): "
    content += "A yellow bicycle beside a stone wall, in the morning light."
    return [{"role": "user", "content": content}]


def chat_body(
    model: str,
    index: int,
    *,
    flag: Flag = None,
    max_tokens: int = 1,
    stream: bool = False,
    pooling: str = "last",
    hooked: bool = False,
) -> bytes:
    """A chat request: ``max_tokens`` tokens, ``ignore_eos`` so that exactly that many come;
    ``hooked``: with a fresh request key for the worker hook (see :class:`Route`)."""
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
    if flag is not None:  # only what the arm asks for: the rest is the proxy's default
        kv: dict[str, Any] = {FLAG: True}
        if flag == "base64":
            kv[FORMAT] = "base64"
        if pooling == "spans":  # "mean" over the spans the bench names
            kv.update({POOLING: "mean", SPANS: BENCH_SPANS})
        elif pooling != "last":
            kv[POOLING] = pooling
        document[KV] = kv
    if hooked:
        document[XARGS] = {REQUEST_KEY_ENTRY: request_key_to_wire(new_request_key())}
    return orjson.dumps(document)


def new_client(
    base_url: str,
    connections: int,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A client whose pool keeps ``connections`` connections alive; with ``api_key`` every
    request carries ``Authorization: Bearer <api_key>``. ``transport`` replaces the network."""
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    limits = httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=connections,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    return httpx.AsyncClient(
        base_url=base_url,
        limits=limits,
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

    def require_ok(self, what: str, vector: bool = False) -> Timed:
        """This answer if it is a 200 (holding a vector, if ``vector``); else ``BenchError``."""
        if self.status != 200:
            text = self.body[:500].decode(errors="replace")
            raise BenchError(f"{what}: HTTP {self.status}: {text}")
        if vector and VECTOR_MARKER not in self.body:
            raise BenchError(f"{what}: a flagged answer without its vector")
        return self


def transport_error(what: str, error: httpx.TransportError) -> BenchError:
    return BenchError(f"{what}: {type(error).__name__}: {error}")


async def timed_post(client: httpx.AsyncClient, path: str, body: bytes) -> Timed:
    start = time.perf_counter()
    try:
        response = await client.post(path, content=body)
    except httpx.TransportError as error:
        raise transport_error(f"POST {client.base_url}{path}", error) from None
    return Timed(time.perf_counter() - start, response.status_code, response.content)


def chat_request(
    client: httpx.AsyncClient, what: str, bodies: Iterator[bytes], vector: bool = False
) -> Request:
    """The chats of ``bodies`` on ``client``, one per call, each answer a 200 (holding its
    vector, if ``vector``)."""

    async def request() -> float:
        timed = await timed_post(client, CHAT_PATH, next(bodies))
        return timed.require_ok(what, vector).seconds

    return request
