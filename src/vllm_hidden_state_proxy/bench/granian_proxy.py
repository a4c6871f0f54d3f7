"""The proxy's app served by granian instead of uvicorn: one more proxy beside the others in the
hop phase (``servers.INSTANT_PROXIES``), so that the choice of front server (issue #25) rests
on numbers from one run. Not a way to deploy the proxy: docs/benchmark.md says why uvicorn
serves it.

It takes ``hidden-state-proxy proxy``'s options. granian gets the limits it has natively: the
head's size (its HTTP/1 buffer), the head's timeout, the requests in progress (its
backpressure); the app keeps its own limits on bodies. granian always serves from worker
processes: each builds the app (``create_app``) from the settings in its environment. Each
counts its own metrics (the bench reads none, and runs one worker): with ``--workers N`` its
``/metrics`` would be that worker's alone, not the sum that uvicorn's workers share.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from granian.constants import HTTPModes, Interfaces, Loops
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server import Server
from starlette.applications import Starlette

from vllm_hidden_state_proxy.protocol import WORKER_SETTINGS_ENV
from vllm_hidden_state_proxy.proxy import settings as proxy_settings
from vllm_hidden_state_proxy.proxy.app import create_app

#: granian's smallest HTTP/1 buffer.
_MIN_BUFFER = 8192


def worker_app() -> Starlette:
    """The app of one granian worker, from the settings :func:`main` put in its environment."""
    return create_app(proxy_settings.ProxySettings.from_json(os.environ[WORKER_SETTINGS_ENV]))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_hidden_state_proxy.bench.granian_proxy",
        description="The proxy under granian (the bench's comparison; not for deployment).",
    )
    proxy_settings.add_arguments(parser, required=("upstream_url",))
    settings = proxy_settings.from_arguments(parser.parse_args(argv))
    os.environ[WORKER_SETTINGS_ENV] = settings.to_json()
    server = Server(
        "vllm_hidden_state_proxy.bench.granian_proxy:worker_app",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        factory=True,
        workers=settings.workers,
        loop=Loops.uvloop,
        http=HTTPModes.http1,
        websockets=False,
        backpressure=settings.max_client_connections,
        http1_settings=HTTP1Settings(
            header_read_timeout=round(settings.head_timeout * 1000),
            max_buffer_size=max(settings.max_head_bytes, _MIN_BUFFER),
        ),
        log_level=LogLevels(settings.log_level),
    )
    server.serve()


if __name__ == "__main__":
    main()
