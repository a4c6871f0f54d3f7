"""reserved_entries.py: every way vLLM turns client input into ``extra_args`` is closed to the
proxy's reserved entries on the routes it passes through, and ordinary bodies pass untouched."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest

from tests.proxy.fakes import FakeRing, FakeVLLM, running, settings_for
from vllm_hidden_state_proxy.protocol import REQUEST_KEY_ENTRY, XARGS_PREFIX
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.proxy.inspection import check_other_endpoint
from vllm_hidden_state_proxy.proxy.reserved_entries import could_spell_reserved, reserved_key_in

pytestmark = pytest.mark.anyio

KEY = "0" * 32
BOUNDARY = "xYzZy"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}".encode()
URLENCODED = b"application/x-www-form-urlencoded"


def multipart(
    fields: dict[str, bytes], *, audio: bytes = b"RIFF\x00\x01fake", charset: str = "utf-8"
) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + audio
        + b"\r\n"
    ]
    for name, value in fields.items():
        head = f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=".encode()
        parts.append(head + b'"' + name.encode(charset) + b'"\r\n\r\n' + value + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def escaped(text: str) -> str:
    """``text`` with every character as a JSON ``\\u`` escape (no byte search can see it)."""
    return "".join(f"\\u{ord(c):04x}" for c in text)


XARGS_JSON = json.dumps({REQUEST_KEY_ENTRY: KEY}).encode()
REFUSED: list[tuple[str, bytes, bytes | None, str]] = [
    # (what, body, content type, param)
    (
        "/inference/v1/generate: sampling_params.extra_args",
        orjson.dumps(
            {"token_ids": [1], "sampling_params": {"extra_args": {REQUEST_KEY_ENTRY: KEY}}}
        ),
        b"application/json",
        "sampling_params",
    ),
    (
        "/v1/responses: vllm_xargs",
        orjson.dumps({"input": "hi", "vllm_xargs": {REQUEST_KEY_ENTRY: KEY}}),
        b"application/json",
        "vllm_xargs",
    ),
    (
        "a key spelled in \\u escapes",
        b'{"vllm_xargs": {"' + escaped(REQUEST_KEY_ENTRY).encode() + b'": "k"}}',
        None,
        "vllm_xargs",
    ),
    (
        "UTF-16 JSON",
        json.dumps({"x": [{"vllm_xargs": {REQUEST_KEY_ENTRY: KEY}}]}).encode("utf-16"),
        b"application/json",
        "x",
    ),
    (
        "a multipart vllm_xargs field (transcriptions)",
        multipart({"model": b"m", "vllm_xargs": XARGS_JSON}),
        MULTIPART,
        "vllm_xargs",
    ),
    (
        "a multipart vllm_xargs field in \\u escapes",
        multipart({"vllm_xargs": b'{"' + escaped(REQUEST_KEY_ENTRY).encode() + b'": "k"}'}),
        MULTIPART,
        "vllm_xargs",
    ),
    (
        "a multipart form in a declared UTF-16 charset",
        multipart({"vllm_xargs": XARGS_JSON.decode().encode("utf-16-le")}, charset="utf-16-le"),
        MULTIPART + b"; charset=utf-16-le",
        "vllm_xargs",
    ),
    (
        "a field named with the prefix",
        multipart({XARGS_PREFIX + "x": b"1"}),
        MULTIPART,
        XARGS_PREFIX + "x",
    ),
    (
        "a percent-encoded urlencoded field (translations)",
        b"model=m&vllm_xargs=" + quote(XARGS_JSON.decode(), safe="").replace("_", "%5F").encode(),
        URLENCODED,
        "vllm_xargs",
    ),
]


@pytest.mark.parametrize(
    ("body", "content_type", "param"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_every_way_in_for_a_reserved_entry_is_refused(
    body: bytes, content_type: bytes | None, param: str
) -> None:
    error = await check_other_endpoint(body, content_type)
    assert error is not None, "a reserved entry would reach vLLM"
    assert (error.status, error.param) == (400, param)
    assert "reserved for the hidden-state proxy" in error.message


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"Hi, hidden_state_proxy_key here", b"text/plain"),
        (b"\x00\x01hidden_state_proxy_key\xff", b"application/octet-stream"),
    ],
)
async def test_what_spells_the_prefix_and_cannot_be_read_is_refused(
    body: bytes, content_type: bytes
) -> None:
    error = await check_other_endpoint(body, content_type)
    assert error is not None and error.status == 400
    assert XARGS_PREFIX in error.message


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (orjson.dumps({"messages": [{"role": "user", "content": XARGS_PREFIX + "key?"}]}), None),
        (orjson.dumps({"input": "x", "vllm_xargs": {"session_id": "s"}}), b"application/json"),
        (multipart({"model": b"m", "vllm_xargs": b'{"session_id": "s"}'}), MULTIPART),
        (multipart({"prompt": b"100% sure", "language": b"en"}), MULTIPART),
        (b"model=m&prompt=100%25+sure", URLENCODED),
    ],
)
async def test_ordinary_bodies_pass(body: bytes, content_type: bytes | None) -> None:
    assert await check_other_endpoint(body, content_type) is None


def test_ordinary_forms_are_not_parsed() -> None:
    audio = bytes(b for b in range(256) if b != ord("\\")) * 4096  # ~1 MB of sound, NULs too
    assert not could_spell_reserved(multipart({"model": b"m"}, audio=audio), MULTIPART)
    assert could_spell_reserved(b"a=%41", URLENCODED)
    assert could_spell_reserved(b"a=b", URLENCODED + b"; charset=utf-16")


def test_reserved_key_in_names_the_path_at_any_depth() -> None:
    deep: Any = {REQUEST_KEY_ENTRY: 1}
    for _ in range(5000):  # deeper than recursion would go
        deep = {"a": [deep]}
    assert reserved_key_in(deep) == "a[0]." * 5000 + REQUEST_KEY_ENTRY
    assert reserved_key_in({"a": [1, "hidden_state_proxy_x"], "b": {"c": 2}}) is None


async def test_the_app_answers_400_and_sends_vllm_nothing() -> None:
    sent: list[httpx.Request] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"ok": True})

    app = create_app(settings_for("/unused"), FakeVLLM(handle).transport, ring=FakeRing())
    async with running(app) as client:
        for what, body, content_type, _ in REFUSED:
            headers = {} if content_type is None else {"content-type": content_type.decode()}
            response = await client.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert response.status_code == 400, what
            assert response.json()["error"]["type"] == "invalid_request_error"
        ordinary = await client.post(
            "/v1/audio/transcriptions",
            content=multipart({"model": b"m"}),
            headers={"content-type": MULTIPART.decode()},
        )
    assert ordinary.status_code == 200
    assert len(sent) == 1 and sent[0].content == multipart({"model": b"m"})
