"""nginx as a reverse-proxy anchor: what one extra HTTP hop costs when it is written in C.

Runs only if an ``nginx`` binary is on PATH; a temporary configuration (one worker, keep-alive
to vLLM, no buffering, no access log) lives in the output directory.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.processes import healthy, stop_process_group

STARTUP_TIMEOUT = 15.0


def nginx_binary() -> str | None:
    return shutil.which("nginx")


def nginx_config(work_dir: Path, listen_port: int, upstream: str) -> str:
    """An nginx.conf that forwards everything on ``listen_port`` to ``upstream`` (host:port)."""
    temp = work_dir / "tmp"
    return f"""\
worker_processes 1;
daemon off;
pid {work_dir}/nginx.pid;
error_log {work_dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    client_max_body_size 32m;
    upstream vllm {{
        server {upstream};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_proxy(binary: str, work_dir: Path, listen_port: int, vllm_url: str) -> Iterator[str]:
    """Run nginx in front of ``vllm_url``; yield its base URL."""
    upstream = urlsplit(vllm_url).netloc
    # Absolute: nginx takes relative paths in its configuration relative to its prefix (-p),
    # so a relative output directory (the default, bench-results) would count twice.
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "tmp").mkdir(exist_ok=True)
    config = work_dir / "nginx.conf"
    config.write_text(nginx_config(work_dir, listen_port, upstream))
    log = work_dir / "nginx.out"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [binary, "-c", str(config), "-p", str(work_dir), "-e", str(work_dir / "error.log")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{listen_port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not healthy(url + "/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                text = log.read_text(errors="replace") + _read(work_dir / "error.log")
                raise BenchError(f"nginx did not start: {text[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        stop_process_group(process, "nginx", grace=5)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
