"""A vLLM stand-in that fails the way a real one can, in a process of its own (issue #36, item
8): ``python -m tests.proxy.dying_vllm MODE RING_DIR``. It prints its port, answers one
request, and fails as MODE says, by dying (SIGKILL: no clean-up, as a crashed engine) or by
falling silent:

- ``crash``: dies after reading the request, before any byte of an answer;
- ``reset``: the same, with a reset (RST) instead of a close;
- ``crash-mid-body``: sends the head of a JSON 200 and part of its body, then dies;
- ``crash-mid-stream``: sends an event stream's head and its first choice (the worker hook's
  record for it published into the real ring in RING_DIR), then dies;
- ``crash-mid-responses-stream``: the same with a Responses API stream;
- ``silent``: never answers;
- ``silent-mid-body``: like ``crash-mid-body``, then stays silent;
- ``silent-mid-stream``: like ``crash-mid-stream``, then stays silent.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import time

import httpx
import orjson

from tests.proxy.fakes import create_writer, is_keyed, publish_for

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
FIRST_CHOICE = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return body


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, ring_dir = sys.argv[1], sys.argv[2]
    writer = create_writer(ring_dir)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    body = read_request(conn)
    if mode == "crash":
        die()
    if mode == "reset":
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        die()
    if mode in ("crash-mid-body", "silent-mid-body"):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        conn.sendall(b"content-length: 4000\r\n\r\n" + b'{"id": "chatcmpl-1", "choi')
        if mode == "crash-mid-body":
            die()  # what was sent still reaches the proxy, then the end of the connection
    if mode in ("crash-mid-stream", "silent-mid-stream"):
        request = httpx.Request("POST", "http://vllm/v1/chat/completions", content=body)
        if is_keyed(request):
            publish_for(writer, request)
        conn.sendall(STREAM_HEAD + b"%x\r\n%s\r\n" % (len(FIRST_CHOICE), FIRST_CHOICE))
        # A partial second event: the proxy must not let its error event land inside it.
        partial = b'data: {"id": "c", "choi'
        conn.sendall(b"%x\r\n%s\r\n" % (len(partial), partial))
        if mode == "crash-mid-stream":
            die()
    if mode == "crash-mid-responses-stream":
        request = httpx.Request("POST", "http://vllm/v1/responses", content=body)
        publish_for(writer, request)
        events = (
            b"".join(
                b"event: %s\ndata: %s\n\n" % (kind, orjson.dumps({"type": kind.decode()}))
                for kind in (b"response.created", b"response.output_item.added")
            )
            + b'event: response.output_text.delta\ndata: {"ty'
        )
        conn.sendall(STREAM_HEAD + b"%x\r\n%s\r\n" % (len(events), events))
        die()
    time.sleep(3600)  # silent: the connection held open until the test kills the process


if __name__ == "__main__":
    main()
