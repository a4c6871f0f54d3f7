"""The connection to vLLM (proxy/upstream.py): the request built for vLLM, where it goes, its
timeouts, and the error a failed exchange becomes."""

from __future__ import annotations

import logging
import socket
from typing import Any

import anyio
import httpx
import pytest

from tests.proxy.fakes import AsgiCall, FakeRing, FakeVLLM, error_of, proxy_client, settings_for
from vllm_hidden_state_proxy.proxy import ProxySettings, upstream
from vllm_hidden_state_proxy.proxy.upstream import build_request, transport_error, upstream_url

pytestmark = pytest.mark.anyio


def scope(path: str = "/v1/models", **details: Any) -> dict[str, Any]:
    built = AsgiCall.scope("POST", path, details.pop("headers", []))
    built.update(details)
    return built


@pytest.mark.parametrize(
    ("upstream", "request_scope", "expected"),
    [
        ("http://vllm:8000", scope(query_string=b"a=1"), "http://vllm:8000/v1/models?a=1"),
        ("http://vllm:8000/", scope(), "http://vllm:8000/v1/models"),
        ("http://vllm:8000/base/", scope(), "http://vllm:8000/base/v1/models"),
        # raw_path kept verbatim (percent-encoding is vLLM's to decode), query split off
        (
            "http://vllm:8000",
            scope("/v1/x y", raw_path=b"/v1/x%20y?ignored", query_string=b"q=%2F"),
            "http://vllm:8000/v1/x%20y?q=%2F",
        ),
        ("http://vllm:8000", scope("/v1/plain", raw_path=None), "http://vllm:8000/v1/plain"),
    ],
)
def test_upstream_url(upstream: str, request_scope: dict[str, Any], expected: str) -> None:
    settings = ProxySettings(upstream_url=upstream)
    assert upstream_url(settings, request_scope) == expected


def test_the_request_carries_the_settings_timeouts() -> None:
    """The transport is called without an AsyncClient: the timeouts must ride on the request."""
    settings = ProxySettings(
        upstream_url="http://vllm:8000", request_timeout=0.5, connect_timeout=2.0
    )
    request = build_request(settings, scope(), b"{}")
    assert request.extensions["timeout"] == {
        "connect": 2.0,
        "read": 0.5,
        "write": 0.5,
        "pool": None,
    }
    assert request.method == "POST"
    assert ProxySettings(upstream_url="http://v").timeouts["read"] is None  # long generations


def test_the_request_has_the_clients_headers_and_nothing_added() -> None:
    settings = ProxySettings(upstream_url="http://vllm:8000")
    headers = [(b"authorization", b"Bearer k"), (b"x-request-id", b"r"), (b"host", b"proxy")]
    request = build_request(
        settings, scope(headers=headers), b"{}", drop=frozenset({b"x-request-id"})
    )
    assert request.headers.raw == [
        (b"Host", b"vllm:8000"),
        (b"authorization", b"Bearer k"),
        (b"content-length", b"2"),
    ]


def test_an_upstream_api_key_replaces_the_clients() -> None:
    settings = ProxySettings(upstream_url="http://vllm:8000", upstream_api_key="vllm-key")
    request = build_request(settings, scope(headers=[(b"authorization", b"Bearer client")]), b"")
    assert request.headers.get_list("authorization") == ["Bearer vllm-key"]


@pytest.mark.parametrize(
    ("error", "status", "fragment"),
    [
        (httpx.ReadTimeout("r secret"), 504, "did not answer in time"),
        (httpx.WriteTimeout("w secret"), 504, "did not answer in time"),
        (httpx.PoolTimeout("p secret"), 504, "did not answer in time"),
        (httpx.ConnectTimeout("c secret"), 502, "Could not reach vLLM"),
        (httpx.ConnectError("c secret"), 502, "Could not reach vLLM"),
        (httpx.ReadError("r secret"), 502, "The exchange with vLLM failed"),
        (httpx.DecodingError("d secret"), 502, "The exchange with vLLM failed"),
    ],
)
def test_transport_errors_map_to_502_or_504_in_words_the_details_logged(
    error: httpx.HTTPError,
    status: int,
    fragment: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream, "_log_state", {"next": 0.0, "skipped": 0})
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        mapped = transport_error(ProxySettings(upstream_url="http://vllm:8000"), error)
        again = transport_error(ProxySettings(upstream_url="http://vllm:8000"), error)
    assert mapped.status == status and fragment in mapped.message
    # Any client may see it: neither vLLM's address nor the exception's text.
    assert "vllm:8000" not in mapped.message and "secret" not in mapped.message
    assert again.message == mapped.message
    # The operator's log has them, once per interval however many requests fail.
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "http://vllm:8000" in logged[0] and "secret" in logged[0]


async def test_a_vllm_that_never_answers_is_a_504_after_the_read_timeout() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        timeout = request.extensions["timeout"]["read"]
        await anyio.sleep(timeout)  # what httpcore does with the extension: give up after it
        raise httpx.ReadTimeout("timed out", request=request)

    settings = settings_for("/unused", request_timeout=0.05)
    async with proxy_client(settings, FakeVLLM(hang), FakeRing()) as proxy:
        response = await proxy.client.get("/v1/models")
    assert response.status_code == 504
    assert error_of(response)["type"] == "gateway_timeout"


async def test_nothing_listening_is_502() -> None:
    """A real connection attempt (no mock transport) to a closed loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = settings_for("/unused", upstream_url=f"http://127.0.0.1:{port}")
    async with proxy_client(settings, None, FakeRing()) as proxy:
        response = await proxy.client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 502
    assert error_of(response)["message"] == "Could not reach vLLM (the proxy's log says why)."


@pytest.mark.parametrize(
    ("method", "upstream", "expected"),
    [
        ("POST", "http://vllm:8000", [(b"Host", b"vllm:8000"), (b"content-length", b"0")]),
        ("GET", "http://vllm:80", [(b"Host", b"vllm")]),
    ],
)
def test_a_request_without_a_body_has_the_headers_httpx_would_give_it(
    method: str, upstream: str, expected: list[tuple[bytes, bytes]]
) -> None:
    """Built with its body as a stream (cheaper), the request still says what httpx's
    ``content=`` would: Host, and a length for a POST; its content is readable."""
    request = build_request(ProxySettings(upstream_url=upstream), scope(method=method), b"")
    assert request.headers.raw == expected and request.content == b""
    assert httpx.Request(method, upstream + "/v1/models", content=b"").headers.raw == [
        (name.capitalize() if name == b"host" else name.title(), value) for name, value in expected
    ]
