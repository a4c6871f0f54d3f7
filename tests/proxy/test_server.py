"""Running the proxy under uvicorn (proxy/server.py)."""

from __future__ import annotations

import pickle

from tests.proxy.fakes import settings_for
from vllm_hidden_state_proxy.proxy.http_protocol import LimitedHttpToolsProtocol
from vllm_hidden_state_proxy.proxy.server import server_config


def test_the_server_uses_the_fast_stack_and_the_settings() -> None:
    config = server_config(settings_for("/unused", host="0.0.0.0", port=8123, log_level="debug"))
    assert (config.loop, config.lifespan) == ("uvloop", "on")
    assert (config.host, config.port, config.log_level) == ("0.0.0.0", 8123, "debug")
    assert config.access_log is False
    assert config.proxy_headers is False
    assert (config.server_header, config.date_header) == (False, False)  # vLLM's pass through
    # The default drain fits in Kubernetes' default 30 s grace period.
    assert config.timeout_graceful_shutdown == 25.0 < 30
    assert (
        server_config(settings_for("/unused", drain_timeout=3.5)).timeout_graceful_shutdown == 3.5
    )


def test_the_front_server_limits_come_from_the_settings_and_travel_to_workers() -> None:
    settings = settings_for(
        "/unused", max_head_bytes=1000, head_timeout=2.5, max_client_connections=7
    )
    config = server_config(settings)
    assert config.limit_concurrency == 7
    # uvicorn builds one protocol per connection from ``http``; --workers pickles it.
    for factory in (config.http, pickle.loads(pickle.dumps(config.http))):
        assert not isinstance(factory, str)
        assert factory.func is LimitedHttpToolsProtocol  # type: ignore[union-attr]
        assert factory.keywords == {"max_head_bytes": 1000, "head_timeout": 2.5}  # type: ignore[union-attr]
