"""Small pure pieces of the bench: options, request bodies, vectors, progress, nginx config,
/proc readings."""

from __future__ import annotations

import argparse
import base64
import http.server
import io
import json
import os
import socket
import struct
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from vllm_hidden_state_proxy.bench import options as bench_options
from vllm_hidden_state_proxy.bench.client import (
    StreamTiming,
    chat_body,
    decode_base64_vector,
    embeddings_body,
    returned_vector,
    tokens_in_event,
)
from vllm_hidden_state_proxy.bench.nginx import nginx_binary, nginx_config, nginx_proxy
from vllm_hidden_state_proxy.bench.pooling import cosine, norm
from vllm_hidden_state_proxy.bench.procs import (
    listening_pid,
    rss_bytes,
    tree_cpu_seconds,
    tree_memory,
)
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.servers import chat_environment
from vllm_hidden_state_proxy.cli import build_parser
from vllm_hidden_state_proxy.processes import free_port


def parse(*argv: str) -> bench_options.BenchOptions:
    args = build_parser().parse_args(["bench", *argv])
    return bench_options.from_args(args)


def test_default_run_starts_everything_and_measures_every_arm() -> None:
    options = parse()
    assert options.proxy_url is None and not options.targets_running_stack
    assert options.requests == bench_options.DEFAULT_REQUESTS
    assert options.concurrency == (1, 4, 16, 64)
    assert options.pooling and options.nginx and options.plot
    assert options.throughput_burst(64) == 128  # every connection twice a round
    assert options.throughput_burst(1) * options.throughput_rounds >= options.requests


def test_smoke_is_tiny_and_skips_the_slow_extras() -> None:
    options = parse("--smoke", "--proxy-url", "http://127.0.0.1:1/", "--vllm-url", "http://h:2")
    assert options.proxy_url == "http://127.0.0.1:1"  # trailing slash dropped
    assert options.requests == bench_options.SMOKE_REQUESTS
    assert options.streams == bench_options.SMOKE_STREAMS
    assert options.throughput_rounds == 1 and options.throughput_burst(16) == 16
    assert not (options.pooling or options.nginx or options.plot)


def test_embeddings_phase_defaults_and_counts() -> None:
    options = parse()
    assert options.embedding_batches == (1, 16, 256)
    # About 4 x --requests inputs per arm and batch size over the 6 rounds, >= 1 request a round.
    assert [options.embedding_requests(b) for b in (1, 16, 256)] == [134, 9, 1]
    smoke = parse("--smoke")
    assert smoke.embedding_batches == (1, 16, 256)  # the smoke run covers the phase too
    assert [smoke.embedding_requests(b) for b in (1, 16, 256)] == [3, 1, 1]
    assert parse("--embedding-batches", "4, 32").embedding_batches == (4, 32)
    assert parse("--no-embeddings").embedding_batches == ()


def test_the_api_key_is_kept_out_of_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_hidden_state_proxy.bench.main import describe

    monkeypatch.delenv(bench_options.API_KEY_ENV, raising=False)
    assert parse().api_key is None
    options = parse("--api-key", "s3cret-key")
    assert options.api_key == "s3cret-key"
    assert "s3cret" not in repr(options)
    assert options.public()["api_key"] == "(set)" and parse().public()["api_key"] is None
    assert "s3cret" not in json.dumps(describe(options))
    assert describe(options)["options"]["output_dir"] == "bench-results"


def test_the_api_key_defaults_to_the_proxys_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_hidden_state_proxy.cli import API_KEY_ENV

    assert bench_options.API_KEY_ENV == API_KEY_ENV
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "given").api_key == "given"


def test_the_started_proxy_gets_the_benchs_key_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(bench_options.API_KEY_ENV, "stray")
    assert bench_options.API_KEY_ENV not in chat_environment(None)
    env = chat_environment("k")
    assert env[bench_options.API_KEY_ENV] == "k" and env["HF_HUB_OFFLINE"] == "1"


def test_target_mode_starts_no_pooling_server_unless_given_one() -> None:
    target = ("--proxy-url", "http://a:1", "--vllm-url", "http://b:2")
    assert not parse(*target).pooling
    assert parse(*target, "--pooling-url", "http://c:3").pooling


@pytest.mark.parametrize(
    "argv",
    [
        ("--proxy-url", "http://a:1"),  # the direct arms need vLLM too
        ("--vllm-url", "http://a:1"),
        ("--requests", "0"),
        ("--concurrency", "1,x"),
        ("--concurrency", "0,4"),
        ("--stream-tokens", "1"),
        ("--embedding-batches", "16,0"),
        ("--embedding-batches", "many"),
        ("--api-key", ""),
        ("--api-key", "  "),
    ],
)
def test_bad_options_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(bench_options.OptionsError):
        parse(*argv)


def test_chat_bodies_flag_only_what_the_arm_asks_for() -> None:
    plain = orjson.loads(chat_body("m", 7))
    assert plain["max_tokens"] == 1 and plain["ignore_eos"] is True
    assert "kv_transfer_params" not in plain and "stream" not in plain
    assert "request 7" in plain["messages"][0]["content"]
    assert orjson.loads(chat_body("m", 1, flag="float"))["kv_transfer_params"] == {
        "return_last_hidden_state": True
    }
    assert orjson.loads(chat_body("m", 1, flag="base64"))["kv_transfer_params"] == {
        "return_last_hidden_state": True,
        "last_hidden_state_format": "base64",
    }
    streamed = orjson.loads(chat_body("m", 1, max_tokens=64, stream=True))
    assert streamed["stream"] is True and streamed["max_tokens"] == 64
    assert streamed["stream_options"] == {"include_usage": True}
    assert streamed["return_token_ids"] is True


def test_tokens_are_counted_per_event_also_when_vllm_merges_them() -> None:
    def event(delta: dict[str, str], token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, object] = {"index": 0, "delta": delta}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return orjson.dumps({"choices": [choice]})

    assert tokens_in_event(event({"role": "assistant", "content": ""})) == 0
    assert tokens_in_event(event({"content": "ab"}, [5, 6, 7])) == 3
    assert tokens_in_event(event({"content": ""}, [9])) == 1  # a partial UTF-8 character
    assert tokens_in_event(event({"content": "x"})) == 1  # no token_ids: one per event
    assert tokens_in_event(orjson.dumps({"choices": [], "usage": {"completion_tokens": 64}})) == 0


def test_the_pooling_request_renders_the_same_chat_prompt() -> None:
    chat = orjson.loads(chat_body("m", 3))
    embed = orjson.loads(embeddings_body("m", 3))
    assert embed["messages"] == chat["messages"]
    assert embed["chat_template_kwargs"] == chat["chat_template_kwargs"]
    assert embed["add_generation_prompt"] is True  # what chat completions do by default
    assert embed["use_activation"] is False  # no normalisation


def test_returned_vectors_in_both_formats() -> None:
    floats = [0.5, -1.25, 3.0]
    packed = base64.b64encode(struct.pack("<3f", *floats)).decode()
    assert returned_vector({"kv_transfer_params": {"last_hidden_state": floats}}) == floats
    assert returned_vector({"kv_transfer_params": {"last_hidden_state": packed}}) == packed
    assert decode_base64_vector(packed) == floats
    assert returned_vector({"kv_transfer_params": {}}) is None
    assert returned_vector({}) is None


def test_stream_timing_tells_a_burst_from_a_stream() -> None:
    assert StreamTiming(0.1, [1e-5] * 62 + [0.01], 64, 0.2).burst
    assert not StreamTiming(0.1, [0.002] * 63, 64, 0.3).burst


def test_cosine_ignores_scale_and_notices_direction() -> None:
    assert cosine([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 1.0]) == pytest.approx(0.0)
    assert norm([3.0, 4.0]) == 5.0
    with pytest.raises(ValueError):
        cosine([1.0], [1.0, 2.0])


def test_progress_prints_tenths_off_a_terminal() -> None:
    stream = io.StringIO()
    task = Progress(stream).task("phase", 20)
    for _ in range(20):
        task.advance()
    task.done("fine")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[bench] phase: 2/20 (10%)"
    assert len(lines) == 10  # nine tenths, then the final line
    assert lines[-1].startswith("[bench] phase: 20/20 in ") and lines[-1].endswith("; fine")


def test_nginx_config_forwards_to_vllm_with_keepalive() -> None:
    text = nginx_config(Path("/w"), 8080, "127.0.0.1:9000")
    assert "listen 127.0.0.1:8080;" in text
    assert "server 127.0.0.1:9000;" in text
    assert "proxy_http_version 1.1;" in text and "keepalive" in text
    assert "proxy_buffering off;" in text and "access_log off;" in text
    assert "pid /w/nginx.pid;" in text


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed")
def test_nginx_runs_from_a_relative_output_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    monkeypatch.chdir(tmp_path)
    binary = nginx_binary()
    assert binary is not None
    try:
        vllm_url = f"http://127.0.0.1:{upstream.server_address[1]}"
        with nginx_proxy(binary, Path("bench-results/nginx"), free_port(), vllm_url) as url:
            assert httpx.get(url + "/health", timeout=10, trust_env=False).status_code == 200
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert (tmp_path / "bench-results/nginx/nginx.conf").is_file()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads Linux's /proc")
def test_proc_readings_of_this_very_process() -> None:
    rss = rss_bytes(os.getpid())
    assert rss is not None and rss > 1024 * 1024
    memory = tree_memory(os.getpid())
    assert memory is not None and memory.processes >= 1 and memory.rss_mib > 1
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert listening_pid(server.getsockname()[1]) == os.getpid()
    assert rss_bytes(2**22 + 12345) is None  # no such process
    before = tree_cpu_seconds(os.getpid())
    sum(i * i for i in range(200_000))  # burn a little CPU
    assert tree_cpu_seconds(os.getpid()) > before > 0


def test_the_bench_subcommand_is_wired_into_the_cli() -> None:
    args = build_parser().parse_args(["bench", "--requests", "5"])
    assert isinstance(args, argparse.Namespace) and args.command == "bench" and args.requests == 5
