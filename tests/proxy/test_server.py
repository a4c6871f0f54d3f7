"""Running the proxy under uvicorn (proxy/server.py)."""

from __future__ import annotations

from tests.proxy.fakes import settings_for
from vllm_hidden_state_proxy.proxy.server import GRACEFUL_SHUTDOWN_SECONDS, server_config


def test_the_server_uses_the_fast_stack_and_the_settings() -> None:
    config = server_config(settings_for("/unused", host="0.0.0.0", port=8123, log_level="debug"))
    assert (config.loop, config.http, config.lifespan) == ("uvloop", "httptools", "on")
    assert (config.host, config.port, config.log_level) == ("0.0.0.0", 8123, "debug")
    assert config.access_log is False
    assert config.proxy_headers is False
    assert (config.server_header, config.date_header) == (False, False)  # vLLM's pass through
    assert config.timeout_graceful_shutdown == GRACEFUL_SHUTDOWN_SECONDS <= 10
