"""Every way vLLM's connection can fail gets its status (issue #36, item 8): the real proxy
(uvicorn, the default engine, a real ring) in front of a vLLM stand-in in a process of its own
that dies or falls silent (``dying_vllm.py``): refused, crashed before answering, reset,
crashed mid-body, silent past the read timeout (before the answer or mid-body); and a flagged
stream already started ends with an error event (502 broken, 504 silent), never cut or looking
complete."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from tests.proxy.fakes import create_writer, settings_for
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.server import server_config

ROOT = Path(__file__).resolve().parents[2]
FLAG = {"kv_transfer_params": {"return_last_hidden_state": True}}
MESSAGES = [{"role": "user", "content": "hi"}]


@contextmanager
def dying_vllm(mode: str, ring_dir: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.proxy.dying_vllm", mode, ring_dir],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield port, process
    finally:
        process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


@contextmanager
def proxy_to(port: int, ring_dir: str) -> Iterator[int]:
    """The real proxy (its default engine, http1) with vLLM at ``port``; its port."""
    settings = settings_for(
        ring_dir,
        upstream_url=f"http://127.0.0.1:{port}",
        request_timeout=1.0,
        vector_timeout=2.0,
        port=0,
        log_level="warning",
    )
    config = server_config(settings)
    config.app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def post(port: int, document: dict[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=30) as client:
        return client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=document)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [
        ("crash", 502, "failed before it answered"),
        ("reset", 502, "failed before it answered"),
        ("crash-mid-body", 502, "failed before it answered"),
        ("silent", 504, "did not answer in time"),
        ("silent-mid-body", 504, "did not answer in time"),
    ],
)
@pytest.mark.parametrize("flagged", [True, False], ids=["flagged", "ordinary"])
def test_a_failure_before_the_reply_is_a_502_or_a_504(
    tmp_path: Path, mode: str, status: int, words: str, flagged: bool
) -> None:
    ring_dir = str(tmp_path / "rings")
    document = {"messages": MESSAGES, **(FLAG if flagged else {})}
    with dying_vllm(mode, ring_dir) as (vllm_port, _), proxy_to(vllm_port, ring_dir) as port:
        if mode.endswith("mid-body") and not flagged:  # passed through: the head is out, so
            # the answer is cut (at once, or past the read timeout), never complete-looking
            with pytest.raises(httpx.RemoteProtocolError):
                post(port, document)
            return
        response = post(port, document)
    assert response.status_code == status, response.text
    assert words in error_of(response)["message"]
    assert error_of(response)["code"] == status


def test_nothing_listening_is_a_502(tmp_path: Path) -> None:
    ring_dir = str(tmp_path / "rings")  # a live ring: the flagged request is sent
    with (
        create_writer(ring_dir),
        dying_vllm("silent", str(tmp_path / "dead")) as (vllm_port, process),
    ):
        process.kill()
        process.wait(10)
        with proxy_to(vllm_port, ring_dir) as port:
            response = post(port, {"messages": MESSAGES, **FLAG})
    assert response.status_code == 502
    assert "Could not reach vLLM" in error_of(response)["message"]


def events_of(body: bytes) -> list[bytes]:
    return [event for event in body.split(b"\n\n") if event]


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [("crash-mid-stream", 502, "broke off"), ("silent-mid-stream", 504, "stopped sending")],
)
def test_a_flagged_stream_that_breaks_off_ends_with_an_error_event(
    tmp_path: Path, mode: str, status: int, words: str
) -> None:
    ring_dir = str(tmp_path / "rings")
    document = {"messages": MESSAGES, "stream": True, **FLAG}
    with dying_vllm(mode, ring_dir) as (vllm_port, _), proxy_to(vllm_port, ring_dir) as port:
        response = post(port, document)  # read whole: the stream ended properly
    assert response.status_code == 200
    first, *rest = events_of(response.content)
    assert b"kv_transfer_params" in first  # the first choice with its vector
    assert len(rest) == 1, rest  # vLLM's partial event never reaches the client
    error = orjson.loads(rest[0].removeprefix(b"data: "))["error"]
    assert error["code"] == status and words in error["message"]


def test_a_flagged_responses_stream_that_breaks_off_ends_with_an_error_event(
    tmp_path: Path,
) -> None:
    ring_dir = str(tmp_path / "rings")
    document = {"input": "hi", "stream": True, **FLAG}
    with (
        dying_vllm("crash-mid-responses-stream", ring_dir) as (vllm_port, _),
        proxy_to(vllm_port, ring_dir) as port,
        httpx.Client(timeout=30) as client,
    ):
        response = client.post(f"http://127.0.0.1:{port}/v1/responses", json=document)
    assert response.status_code == 200
    *events, last = events_of(response.content)
    assert [e.split(b"\n")[0] for e in events] == [
        b"event: response.created",
        b"event: response.output_item.added",
    ]
    assert last.startswith(b"event: error\ndata: ")
    error = orjson.loads(last.split(b"data: ", 1)[1])["error"]
    assert error["code"] == 502 and "broke off" in error["message"]


def test_an_ordinary_stream_that_breaks_off_is_cut(tmp_path: Path) -> None:
    """Passed through byte for byte: the client sees a truncated response, as from vLLM."""
    ring_dir = str(tmp_path / "rings")
    document = {"messages": MESSAGES, "stream": True}
    with (
        dying_vllm("crash-mid-stream", ring_dir) as (vllm_port, _),
        proxy_to(vllm_port, ring_dir) as port,
        pytest.raises(httpx.RemoteProtocolError),
    ):
        post(port, document)
