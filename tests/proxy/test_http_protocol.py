"""The front door's writes (proxy/http_protocol.py): a response's head, which uvicorn writes
alone, goes out with the first body bytes written in the same turn of the loop, in one write
(issue #46); a head whose body does not follow at once goes out alone on the loop's next turn;
``100 Continue`` is never held. (The head limits are tested through the real server:
``test_front_limits.py``.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from vllm_hidden_state_proxy.proxy.http_protocol import _HeadWithBody

pytestmark = pytest.mark.anyio


class _Recording:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _through(recording: _Recording) -> Any:
    return _HeadWithBody(recording)  # type: ignore[arg-type]


async def test_a_head_and_its_first_body_bytes_go_out_in_one_write() -> None:
    recording = _Recording()
    transport = _through(recording)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"body")
    transport.write(b"more")
    await asyncio.sleep(0)
    assert recording.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]


async def test_a_head_alone_goes_out_on_the_next_turn() -> None:
    recording = _Recording()
    transport = _through(recording)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert recording.writes == []
    await asyncio.sleep(0)
    assert recording.writes == [b"HTTP/1.1 200 OK\r\n\r\n"]
    transport.write(b"later")
    assert recording.writes[-1] == b"later"


async def test_continue_is_not_held_and_close_flushes_the_head() -> None:
    recording = _Recording()
    transport = _through(recording)
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert recording.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    transport.close()
    assert recording.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n" and recording.closed
