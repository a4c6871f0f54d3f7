"""An instant upstream for the proxy: a bare uvicorn ASGI app that answers every chat at once
with a canned one-token completion (JSON, or SSE when the request streams), and every
completion with a canned text completion. For a flagged request it does the worker hook's part
too: it publishes a vector (or, with ``--matrix-bytes``, an ``"all_prompt"`` matrix of that
size) into a real ring under the request key, so that the proxy's flagged path runs end to
end.

Run as ``python benchmarks/instant_upstream.py --port P --ring-dir D``.
"""

from __future__ import annotations

import argparse
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import orjson
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_hidden_state_proxy.protocol import (
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    request_key_from_wire,
)
from vllm_hidden_state_proxy.ring import RingWriter
from vllm_hidden_state_proxy.ring.layout import arena_block_size
from vllm_hidden_state_proxy.worker_hook.settings import RING_SLOTS

#: The tiny model's hidden size: the instant arms measure the hop's fixed cost (the cost that
#: grows with the vector is the ring microbenchmark's).
HIDDEN_SIZE = 128
PROMPT_TOKENS = 24
MODEL = "instant"
_CHOICE = {"index": 0, "finish_reason": "length", "logprobs": None}
_USAGE = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
_HEAD = {"id": "chatcmpl-instant", "created": 0, "model": MODEL}
COMPLETION = orjson.dumps(
    {
        **_HEAD,
        "object": "chat.completion",
        "choices": [{**_CHOICE, "message": {"role": "assistant", "content": "x"}}],
        "usage": _USAGE,
    }
)
_CHUNK = {**_HEAD, "object": "chat.completion.chunk"}
STREAM = (
    b"".join(
        b"data: " + orjson.dumps(event) + b"\n\n"
        for event in (
            {
                **_CHUNK,
                "choices": [
                    {
                        **_CHOICE,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            },
            {**_CHUNK, "choices": [{**_CHOICE, "delta": {"content": "x"}}]},
            {**_CHUNK, "choices": [], "usage": _USAGE},
        )
    )
    + b"data: [DONE]\n\n"
)
TEXT_COMPLETION = orjson.dumps(
    {
        **_HEAD,
        "object": "text_completion",
        "choices": [{**_CHOICE, "text": "x"}],
        "usage": _USAGE,
    }
)
_FLAGGED = REQUEST_KEY_ENTRY.encode()
_STREAMED = b'"stream":true'


def ring_publisher(
    directory: Path, hidden_size: int = HIDDEN_SIZE, matrix_bytes: int = 0
) -> Callable[[bytes], None]:
    """Every use of the ring: create one in ``directory`` and return what publishes a vector
    under the request key in a flagged request body (the worker hook's part, faked). With
    ``matrix_bytes``, the ring has an arena for eight such matrices, and a request for
    ``"all_prompt"`` gets a matrix of that size (the matrix arm, ``matrices.py``)."""
    rows = max(1, matrix_bytes // (4 * hidden_size))
    writer = RingWriter.create(
        directory,
        hidden_size=hidden_size,
        model=MODEL,
        slot_count=RING_SLOTS.default,
        arena_size=8 * (rows * 4 * hidden_size + 4096) if matrix_bytes else 0,
        # The max record counts the arena block's header.
        max_record=arena_block_size(rows * 4 * hidden_size) if matrix_bytes else None,
    )
    vector = struct.pack(f"<{hidden_size}f", *(i / hidden_size for i in range(hidden_size)))
    matrix = b""
    if matrix_bytes:
        values = np.random.default_rng(0).standard_normal(rows * hidden_size)
        matrix = values.astype("<f4").tobytes()

    def publish(body: bytes) -> None:
        xargs = orjson.loads(body).get("vllm_xargs")
        wire = xargs.get(REQUEST_KEY_ENTRY) if isinstance(xargs, dict) else None
        key = request_key_from_wire(wire)
        if key is None:
            return
        if matrix and xargs.get(POOLING_ENTRY) == "all_prompt":
            writer.publish(
                key, matrix, position=0, num_prompt_tokens=rows, pooling="all_prompt", rows=rows
            )
            return
        writer.publish(key, vector, position=PROMPT_TOKENS - 1, num_prompt_tokens=PROMPT_TOKENS)

    return publish


def instant_app(publish: Callable[[bytes], None]) -> ASGIApp:
    """The app: ``GET /health``, ``POST /v1/chat/completions``, 404 for anything else. Only
    flagged bodies are parsed; the others are answered without a look inside."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, content, kind = 404, b"", b"text/plain"
        if scope["path"] == "/health":
            status = 200
        elif scope["path"] == "/v1/chat/completions":
            if _FLAGGED in body:
                publish(body)
            status = 200
            content, kind = (
                (STREAM, b"text/event-stream")
                if _STREAMED in body
                else (COMPLETION, b"application/json")
            )
        elif scope["path"] == "/v1/completions":  # one prompt (the proxy fans lists out)
            if _FLAGGED in body:
                publish(body)
            status, content, kind = 200, TEXT_COMPLETION, b"application/json"
        headers = [(b"content-type", kind), (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ring-dir", type=Path, required=True)
    parser.add_argument("--uds", help="also listen on this Unix domain socket")
    parser.add_argument(
        "--matrix-bytes", type=int, default=0, help="publish all_prompt matrices of this size"
    )
    args = parser.parse_args(argv)
    config = uvicorn.Config(
        instant_app(ring_publisher(args.ring_dir, matrix_bytes=args.matrix_bytes)),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    sockets = [config.bind_socket()]
    if args.uds:
        config.uds = args.uds
        sockets.append(config.bind_socket())
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
