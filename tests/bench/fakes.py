"""vLLM and the proxy faked as one ``httpx.MockTransport`` handler, for the phases' tests."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson

from vllm_hidden_state_proxy.bench.client import ChatStack

HIDDEN = 4


class FakeServers:
    """Chat on both hosts (JSON, or a stream of the tokens asked for; a flagged answer holds a
    vector), ``/v1/embeddings`` on the proxy; every request recorded as (host, path, body)."""

    def __init__(self, short_after: int | None = None, failing: int | None = None) -> None:
        #: After this many embeddings requests, answer one vector short.
        self.short_after = short_after
        #: Answer this request (counting from 1) with a 503.
        self.failing = failing
        self.seen: list[tuple[str, str, dict[str, Any]]] = []
        self.authorization: set[tuple[str, str | None]] = set()
        self.in_flight = self.peak = 0

    def stack(self, api_key: str | None = None) -> ChatStack:
        return ChatStack("http://proxy", "http://vllm", "m", api_key, httpx.MockTransport(self))

    def count(self, host: str, path: str = "/v1/chat/completions") -> int:
        return sum(1 for h, p, _ in self.seen if (h, p) == (host, path))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        document: dict[str, Any] = orjson.loads(request.content)
        self.seen.append((host, path, document))
        self.authorization.add((host, request.headers.get("authorization")))
        if len(self.seen) == self.failing:
            return httpx.Response(503, text="busy")
        if path == "/v1/embeddings":
            assert host == "proxy"
            count = len(document["input"])
            if self.short_after is not None and self.count("proxy", path) > self.short_after:
                count -= 1
            data = [
                {"object": "embedding", "index": i, "embedding": [0.5] * HIDDEN}
                for i in range(count)
            ]
            return httpx.Response(200, content=orjson.dumps({"object": "list", "data": data}))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await anyio.sleep(0.001)
        self.in_flight -= 1
        kv = {"last_hidden_state": [0.5] * HIDDEN} if "kv_transfer_params" in document else None
        if document.get("stream"):
            tokens = [{"choices": [{"delta": {"content": "x"}, "token_ids": [1]}]}]
            events = tokens * document["max_tokens"]
            body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
            return httpx.Response(200, content=body + b"data: [DONE]\n\n")
        return httpx.Response(
            200, json={"choices": [{"message": {"content": "x"}}], "kv_transfer_params": kv}
        )
