"""The SSE scanner: finds the first choice-bearing event, however the bytes are chunked."""

from __future__ import annotations

import orjson
import pytest

from vllm_hidden_state_proxy.proxy.sse import (
    ChoiceEvent,
    FirstChoiceScanner,
    StreamEnded,
    replace_event,
)

ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3}}'
STREAM = b": comment\n\n" + USAGE + b"\n\n" + ROLE + b"\n\n" + b"data: [DONE]\n\n"


def scan_in_pieces(stream: bytes, size: int) -> tuple[ChoiceEvent | StreamEnded | None, bytes]:
    scanner = FirstChoiceScanner()
    buffer = bytearray()
    for start in range(0, len(stream), size):
        buffer += stream[start : start + size]
        found = scanner.scan(buffer)
        if found is not None:
            return found, bytes(buffer)
    return None, bytes(buffer)


@pytest.mark.parametrize("size", [1, 2, 7, 64, 10_000])
def test_first_choice_event_found_at_any_chunking(size: int) -> None:
    found, buffer = scan_in_pieces(STREAM, size)
    assert isinstance(found, ChoiceEvent)
    assert buffer[found.start : found.end] == ROLE
    assert found.chunk["choices"][0]["delta"] == {"role": "assistant"}


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_other_line_endings(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    found, buffer = scan_in_pieces(stream, 5)
    assert isinstance(found, ChoiceEvent)
    assert buffer[found.start : found.end] == ROLE


def test_done_before_any_choice_ends_the_scan() -> None:
    error = b'data: {"error": {"message": "boom", "code": 400}}\n\n'
    found, _ = scan_in_pieces(error + b"data: [DONE]\n\n" + ROLE + b"\n\n", 3)
    assert isinstance(found, StreamEnded)


def test_incomplete_event_needs_more_bytes() -> None:
    assert FirstChoiceScanner().scan(ROLE) is None


def test_replace_event_keeps_every_other_byte() -> None:
    found, buffer = scan_in_pieces(STREAM, 4)
    assert isinstance(found, ChoiceEvent)
    out = replace_event(buffer, found, {**found.chunk, "kv_transfer_params": {"v": 1}})
    before, after = buffer[: found.start], buffer[found.end :]
    assert out.startswith(before) and out.endswith(after)
    middle = out[len(before) : len(out) - len(after)]
    assert middle.startswith(b"data: ")
    assert orjson.loads(middle[6:])["kv_transfer_params"] == {"v": 1}
