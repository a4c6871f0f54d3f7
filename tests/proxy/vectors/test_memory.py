"""Issue #36, items 1-3: the memory matrices take in the proxy is bounded (per request and per
process), a large reply is sent in pieces with a deadline per piece, and the big work (copy,
CRC, encoding) runs off the event loop. A real proxy in front of a fake vLLM that publishes
into a real ring; the deadline against real uvicorn and a client that never reads."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import anyio.to_thread
import httpx
import numpy as np
import orjson
import pytest
import uvicorn

from tests.proxy.fakes import (
    FINAL,
    HIDDEN_SIZE,
    MODEL,
    FakeVLLM,
    create_writer,
    error_of,
    forwarded_key,
    proxy_client,
    publish,
    sent_document,
    settings_for,
)
from tests.proxy.raw_http import wait_until
from tests.proxy.vectors.test_answers import ANSWERS, PROMPT_TOKENS, stream_events
from vllm_hidden_state_proxy.protocol import answer_key
from vllm_hidden_state_proxy.proxy import create_app, replies
from vllm_hidden_state_proxy.proxy.replies import PIECE_BYTES, matrix_pieces
from vllm_hidden_state_proxy.proxy.server import server_config
from vllm_hidden_state_proxy.proxy.vectors.encoding import Matrix
from vllm_hidden_state_proxy.ring import PendingRows, Record, RingWriter
from vllm_hidden_state_proxy.wanted_vectors import as_dtype, bfloat16_bits

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
MIB = 1 << 20
ROW = 4 * HIDDEN_SIZE


def rows_for(key: bytes, rows: int) -> bytes:
    values = np.random.default_rng(int.from_bytes(key[:4], "little"))
    return values.standard_normal(rows * HIDDEN_SIZE).astype("<f4").tobytes()


def matrix_vllm(writer: RingWriter, rows: int) -> FakeVLLM:
    """A completions server whose hook publishes an ``all_prompt`` matrix of ``rows`` rows for
    each keyed request."""

    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        sent_document(request)
        record = Record(
            key, MODEL, 0, rows, "all_prompt", (FINAL,), HIDDEN_SIZE, rows_for(key, rows), rows
        )
        publish(writer, record)
        reply = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": rows, "completion_tokens": 1, "total_tokens": rows + 1},
        }
        if sent_document(request).get("stream") is True:
            chunk = {**reply, "object": "text_completion", "usage": None}
            events = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=events
            )
        return httpx.Response(200, json=reply)

    return FakeVLLM(handle)


def flagged(prompt: Any, **kv: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {
            "return_last_hidden_state": True,
            "last_hidden_state_pooling": "all_prompt",
            **kv,
        },
    }


@pytest.fixture
def big_writer(ring_dir: str) -> Iterator[RingWriter]:
    with create_writer(
        ring_dir, arena_size=97 * MIB, max_record=32 * MIB + 4096, slot_count=64
    ) as w:
        yield w


# -- item 1: one bound for a request's matrices, and one for the process's -----------------------


async def test_a_prompt_list_of_matrices_past_the_request_bound_is_413(
    ring_dir: str, big_writer: RingWriter
) -> None:
    """40 prompts x 1 MiB matrices against an 8 MiB bound: a 413 naming the option, never a
    40 MiB reply; the memory is given back."""
    vllm = matrix_vllm(big_writer, MIB // ROW)
    settings = settings_for(ring_dir, max_vectors_bytes=8 * MIB, fan_out_limit=4)
    async with proxy_client(settings, vllm) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=flagged(["a b c"] * 40))
        memory = proxy.app.state.proxy.vector_memory
        assert memory.held == 0
        assert memory.peak <= 8 * MIB
        fits = await proxy.client.post(COMPLETIONS, json=flagged(["a b c"] * 3))
    assert response.status_code == 413, response.text[:300]
    assert "--max-vectors-size" in error_of(response)["message"]
    assert proxy.app.state.proxy.metrics.vector_refusals["request"] == 1
    assert len(vllm.requests) < 40  # the rest cancelled once over the bound
    assert fits.status_code == 200
    assert len(fits.json()["kv_transfer_params"]["last_hidden_states"]) == 3


async def test_token_id_prompts_past_the_request_bound_are_refused_before_sending(
    ring_dir: str, big_writer: RingWriter
) -> None:
    vllm = matrix_vllm(big_writer, 4)
    settings = settings_for(ring_dir, max_vectors_bytes=MIB)
    ids = [[1] * (MIB // ROW // 2 + 1)] * 2  # two prompts whose rows take just over 1 MiB
    async with proxy_client(settings, vllm) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=flagged(ids))
    assert response.status_code == 413
    error = error_of(response)
    assert error["param"] == "prompt" and "--max-vectors-size" in error["message"]
    assert proxy.app.state.proxy.metrics.vector_refusals["request"] == 1
    assert vllm.requests == []


async def test_an_answer_matrix_past_the_request_bound_is_refused_before_sending(
    ring_dir: str, big_writer: RingWriter
) -> None:
    vllm = matrix_vllm(big_writer, 4)
    settings = settings_for(ring_dir, max_vectors_bytes=MIB)
    body = {**flagged("a"), "max_tokens": MIB // ROW // 4 + 1, "n": 4}
    body["kv_transfer_params"]["last_hidden_state_pooling"] = "all_answer"
    async with proxy_client(settings, vllm) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=body)
    assert response.status_code == 413
    error = error_of(response)
    assert error["param"] == "max_tokens" and "--max-vectors-size" in error["message"]
    assert vllm.requests == []


async def test_a_matrix_past_the_process_budget_is_503_before_its_copy(
    ring_dir: str, big_writer: RingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[int] = []
    real_load = PendingRows.load

    def counted(self: PendingRows) -> Any:
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(PendingRows, "load", counted)
    vllm = matrix_vllm(big_writer, 2 * MIB // ROW)
    settings = settings_for(ring_dir, vectors_budget_bytes=8 * MIB)
    async with proxy_client(settings, vllm) as proxy:
        memory = proxy.app.state.proxy.vector_memory
        memory.held = 7 * MIB  # other requests' matrices
        response = await proxy.client.post(COMPLETIONS, json=flagged("a b c"))
        assert memory.held == 7 * MIB
        memory.held = 0
        fits = await proxy.client.post(COMPLETIONS, json=flagged("a b c"))
    assert response.status_code == 503
    assert "--vectors-budget" in error_of(response)["message"]
    assert proxy.app.state.proxy.metrics.vector_refusals["budget"] == 1
    assert loads == [2 * MIB]  # the refused one was never copied
    assert fits.status_code == 200


# -- items 2 and 3: large answers in pieces, off the loop -----------------------------------------


@pytest.mark.parametrize(
    ("fmt", "dtype"), [("base64", "float32"), ("base64", "bfloat16"), ("float", "float32")]
)
async def test_a_large_matrix_is_sent_in_pieces_encoded_off_the_loop(
    ring_dir: str,
    big_writer: RingWriter,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    dtype: str,
) -> None:
    threads: list[str] = []
    real_load = PendingRows.load

    def where(self: PendingRows) -> Any:
        threads.append(threading.current_thread().name)
        return real_load(self)

    monkeypatch.setattr(PendingRows, "load", where)
    rows = 3 * MIB // ROW + 5
    vllm = matrix_vllm(big_writer, rows)
    kv = {"last_hidden_state_format": fmt, "last_hidden_state_dtype": dtype}
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(COMPLETIONS, json=flagged("a b c", **kv))
        memory = proxy.app.state.proxy.vector_memory
        assert memory.held == 0
        assert memory.peak <= 3 * MIB + rows * ROW // 100 + 2 * PIECE_BYTES + 64 * 1024
    assert response.status_code == 200, response.text[:300]
    assert "content-length" not in response.headers  # sent in pieces
    assert threads and threading.main_thread().name not in threads
    matrix = response.json()["kv_transfer_params"]["last_hidden_state"]
    want = rows_for(forwarded_key(vllm.requests[0]), rows)
    assert matrix["shape"] == [rows, HIDDEN_SIZE]
    if fmt == "float":
        got = np.asarray(matrix["data"], dtype=np.float32)
        assert np.array_equal(got, np.frombuffer(want, "<f4").reshape(rows, HIDDEN_SIZE))
    else:
        assert base64.b64decode(matrix["data"]) == bytes(as_dtype(want, dtype))


async def test_a_large_matrix_in_a_stream_is_encoded_off_the_loop_and_counted(
    ring_dir: str, big_writer: RingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = anyio.to_thread.run_sync

    async def watched(function: Any, *args: Any, **kwargs: Any) -> Any:
        def where() -> Any:
            threads.append(threading.current_thread().name)
            return function(*args)

        return await real(where, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", watched)
    rows = MIB // ROW
    vllm = matrix_vllm(big_writer, rows)
    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        response = await proxy.client.post(COMPLETIONS, json={**flagged("a"), "stream": True})
        memory = proxy.app.state.proxy.vector_memory
        assert memory.held == 0 and memory.peak >= 2 * rows * ROW  # rows and text counted
    assert response.status_code == 200
    first = response.text.split("\n\n")[0].removeprefix("data: ")
    matrix = orjson.loads(first)["kv_transfer_params"]["last_hidden_state"]
    assert base64.b64decode(matrix["data"]) == rows_for(forwarded_key(vllm.requests[0]), rows)
    assert threads and threading.main_thread().name not in threads


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 100_003])
def test_matrix_pieces_join_into_the_whole_encoding(dtype: str, count: int) -> None:
    rows = np.random.default_rng(count).standard_normal(count * HIDDEN_SIZE).astype("<f4")
    for fmt in ("base64", "float"):
        matrix = Matrix(rows.tobytes(), count, HIDDEN_SIZE, fmt, dtype)
        text = b"".join(piece() for piece in matrix_pieces(matrix))
        whole = orjson.dumps(matrix.encoded(), option=orjson.OPT_SERIALIZE_NUMPY)
        assert text == whole


def _reference_bfloat16(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The proxy's hand-written rounding before ml_dtypes (round to nearest even, NaN kept)."""
    bits = values.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype("<u2")


def test_bfloat16_rounding_is_bit_identical_to_the_hand_written_one() -> None:
    """Every upper half with lower halves at the rounding edges (ties, just below and above,
    NaN payloads, infinities, subnormals, the largest finite values), and random bits."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32)
    edges = (upper[:, None] | lower[None, :]).ravel()
    randoms = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    for bits in (edges, randoms.astype(np.uint32)):
        values = bits.view("<f4")
        assert np.array_equal(bfloat16_bits(values), _reference_bfloat16(values))
    nan = struct.unpack("<H", bytes(as_dtype(struct.pack("<I", 0xFF812345), "bfloat16")))[0]
    assert nan == 0xFFC1  # sign and payload kept, made quiet


# -- item 2: a client that stops reading is cut off --------------------------------------------


@contextmanager
def served(settings: Any, vllm: FakeVLLM) -> Iterator[tuple[int, uvicorn.Server, Any]]:
    config = server_config(settings)
    app = create_app(settings, vllm.transport)
    config.app = app
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "uvicorn started", 60)
    try:
        yield sock.getsockname()[1], server, app.state.proxy
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def request_head(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()


def silent_client(port: int, request: bytes) -> socket.socket:
    """A connection that sends ``request`` and never reads (a small receive window)."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(request)
    return client


def wait_for_the_cut(server: uvicorn.Server, state: Any, client: socket.socket) -> None:
    try:
        wait_until(lambda: state.vector_memory.peak > 0, "the vectors were taken", 30)
        wait_until(
            lambda: not server.server_state.connections and state.vector_memory.held == 0,
            "the silent client's connection was cut and its memory given back",
            30,
        )
    finally:
        client.close()
    assert state.metrics.send_cuts == 1


def test_a_client_that_stops_reading_is_cut_off_and_its_memory_freed(
    ring_dir: str, big_writer: RingWriter, caplog: pytest.LogCaptureFixture
) -> None:
    rows = 16 * MIB // ROW
    vllm = matrix_vllm(big_writer, rows)
    settings = settings_for(ring_dir, send_timeout=0.5)
    body = orjson.dumps(flagged("a b c"))
    caplog.set_level(logging.INFO, "vllm_hidden_state_proxy.proxy")
    with served(settings, vllm) as (port, server, state):
        wait_for_the_cut(server, state, silent_client(port, request_head(COMPLETIONS, body) + body))
        assert any("--send-timeout" in record.getMessage() for record in caplog.records)
        # A client that reads gets the whole reply from the same server.
        reply = httpx.post(f"http://127.0.0.1:{port}{COMPLETIONS}", content=body, timeout=60)
        assert reply.status_code == 200
        matrix = reply.json()["kv_transfer_params"]["last_hidden_state"]
        assert len(base64.b64decode(matrix["data"])) == rows * ROW


def test_a_client_that_reads_too_slowly_is_cut_at_the_replys_deadline(
    ring_dir: str, big_writer: RingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that takes a piece every quarter --send-timeout never misses the per-send bound,
    but is cut once the whole reply's deadline (--send-timeout + its size at the least rate)
    has passed, long before it would have read the reply. No bound on the test's own timing:
    the reader has four times the per-send bound's margin, and what is checked is the state (cut,
    its memory given back, the reply unread)."""
    monkeypatch.setattr(replies, "MIN_SEND_RATE", 64 * MIB)  # 4 s + 21 MiB: 4.3 s
    rows = 16 * MIB // ROW
    vllm = matrix_vllm(big_writer, rows)
    send_timeout = 4.0
    settings = settings_for(ring_dir, send_timeout=send_timeout)
    body = orjson.dumps(flagged("a b c"))
    with served(settings, vllm) as (port, server, state):
        client = silent_client(port, request_head(COMPLETIONS, body) + body)
        client.settimeout(60)  # the proxy cuts it long before
        received = 0
        try:
            while True:  # about 1.4 MiB a second: 15 s for the reply
                burst = 0
                while burst < PIECE_BYTES:
                    data = client.recv(PIECE_BYTES - burst)
                    if not data:
                        raise ConnectionResetError
                    burst += len(data)
                received += burst
                time.sleep(send_timeout / 4)
        except ConnectionResetError:
            pass
        finally:
            client.close()
        wait_until(
            lambda: not server.server_state.connections and state.vector_memory.held == 0,
            "the slow client's memory was given back",
            30,
        )
        assert state.metrics.send_cuts == 1
    assert received < 16 * MIB, received  # cut before its reply (21 MiB of base64) was read


def test_a_stream_event_with_a_matrix_has_a_send_deadline(
    ring_dir: str, big_writer: RingWriter
) -> None:
    vllm = matrix_vllm(big_writer, 16 * MIB // ROW)
    settings = settings_for(ring_dir, send_timeout=0.5)
    body = orjson.dumps({**flagged("a b c"), "stream": True})
    with served(settings, vllm) as (port, server, state):
        wait_for_the_cut(server, state, silent_client(port, request_head(COMPLETIONS, body) + body))


def test_a_stream_event_with_an_answers_vector_has_a_send_deadline(ring_dir: str) -> None:
    """ "last_answer" in a stream (streams/answer_vectors.py): the event of the last chunk."""
    hidden = 1 << 19  # 2 MiB a vector: about 6 MiB as float text

    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        count = len(ANSWERS[0])
        vector = np.full(hidden, 0.123456789, "<f4").tobytes()
        for chosen in range(max(1, count - 2), count + 2):  # the hook's window of positions
            position = PROMPT_TOKENS + chosen - 2
            record = Record(
                answer_key(key, 0, chosen),
                MODEL,
                position,
                PROMPT_TOKENS,
                "last_answer",
                (FINAL,),
                hidden,
                vector,
            )
            publish(writer, record)
        events = b"".join(stream_events(1, continuous=True, usage=True))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)

    with create_writer(ring_dir, hidden_size=hidden, slot_count=16) as writer:
        settings = settings_for(ring_dir, send_timeout=0.5)
        kv = {
            "return_last_hidden_state": True,
            "last_hidden_state_pooling": "last_answer",
            "last_hidden_state_format": "float",
        }
        messages = [{"role": "user", "content": "Hi"}]
        body = orjson.dumps(
            {"model": MODEL, "messages": messages, "stream": True, "kv_transfer_params": kv}
        )
        with served(settings, FakeVLLM(handle)) as (port, server, state):
            request = request_head(CHAT, body) + body
            wait_for_the_cut(server, state, silent_client(port, request))


def test_an_embeddings_response_has_a_send_deadline(ring_dir: str) -> None:
    hidden = 1 << 17  # 512 KiB a vector: 16 inputs take 11 MiB as base64

    async def handle(request: httpx.Request) -> httpx.Response:
        key = forwarded_key(request)
        vector = np.full(hidden, 0.5, "<f4").tobytes()
        publish(writer, Record(key, MODEL, 4, 5, "last", (FINAL,), hidden, vector))
        return httpx.Response(200, json={"id": "c", "model": MODEL, "choices": []})

    with create_writer(ring_dir, hidden_size=hidden, slot_count=64) as writer:
        settings = settings_for(ring_dir, send_timeout=0.5)
        body = orjson.dumps(
            {"model": MODEL, "input": [f"text {i}" for i in range(16)], "encoding_format": "base64"}
        )
        with served(settings, FakeVLLM(handle)) as (port, server, state):
            request = request_head(EMBEDDINGS, body) + body
            wait_for_the_cut(server, state, silent_client(port, request))


# -- item 3: the event loop keeps turning while a large matrix is served --------------------------


async def test_the_event_loop_keeps_turning_while_a_large_matrix_is_served(
    ring_dir: str, big_writer: RingWriter
) -> None:
    """The loop thread never works on the matrix in one long stretch: between two turns of a
    ticker it spends little CPU. Counted in the loop thread's own CPU time (``thread_time``),
    which a loaded machine does not stretch, not in wall time."""
    rows = 32 * MIB // ROW
    vllm = matrix_vllm(big_writer, rows)
    stretches: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.thread_time()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.thread_time()
            stretches.append(now - last)
            last = now

    async with proxy_client(settings_for(ring_dir), vllm) as proxy:
        ticker = asyncio.get_running_loop().create_task(tick())
        response = await proxy.client.post(
            COMPLETIONS, json=flagged("a b c", last_hidden_state_dtype="bfloat16")
        )
        done.set()
        await ticker
    assert response.status_code == 200
    # Before: copy, CRC, rounding and base64 of 32 MiB ran on the loop in one go (>= 0.3 s of
    # CPU). The httpx in-process client joins the pieces on the loop: allow it its share.
    assert max(stretches) < 0.1, max(stretches)


async def test_a_large_matrix_taken_early_survives_its_block_being_written_over(
    ring_dir: str,
) -> None:
    """A long generation: the early capture copies the matrix while vLLM still works, so newer
    matrices that write over its arena block afterwards cannot take it away (a 200, not a
    503), and it is counted once."""
    rows = MIB // ROW
    keys: list[bytes] = []

    def matrix(key: bytes) -> Record:
        return Record(
            key, MODEL, 0, rows, "all_prompt", (FINAL,), HIDDEN_SIZE, rows_for(key, rows), rows
        )

    with create_writer(
        ring_dir, arena_size=3 * MIB + 4096, max_record=MIB + 4096, slot_count=64
    ) as writer:

        async def body() -> AsyncIterator[bytes]:
            yield b'{"id": "c", "object": "text_completion", '
            await asyncio.sleep(0.5)  # still answering: the early capture takes the matrix
            for other in range(4):  # newer matrices go round the arena
                publish(writer, matrix(bytes([other + 1]) * 16))
            yield b'"model": "m", "choices": []}'

        async def handle(request: httpx.Request) -> httpx.Response:
            keys.append(forwarded_key(request))
            publish(writer, matrix(keys[0]))
            headers = {"content-type": "application/json"}
            return httpx.Response(200, headers=headers, content=body())

        async with proxy_client(settings_for(ring_dir), FakeVLLM(handle)) as proxy:
            response = await proxy.client.post(COMPLETIONS, json=flagged("a"))
            memory = proxy.app.state.proxy.vector_memory
            assert memory.held == 0 and memory.peak <= rows * ROW + 2 * PIECE_BYTES + 64 * 1024
    assert response.status_code == 200, response.text[:300]
    data = response.json()["kv_transfer_params"]["last_hidden_state"]["data"]
    assert base64.b64decode(data) == rows_for(keys[0], rows)
