"""Command line: ``hidden-state-proxy serve|proxy|build-tiny-model|bench``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .bench.options import add_arguments as add_bench_arguments
from .protocol import RING_DIR_ENV, ring_dir_from_env
from .proxy.embeddings_request import DEFAULT_TEMPLATE, check_template

DEFAULT_PORT = 8000
DEFAULT_VLLM_PORT = 8001
DEFAULT_VECTOR_TIMEOUT = 5.0
#: Read by the proxy (compose and the Helm chart set it): the embedding template.
EMBEDDING_TEMPLATE_ENV = "HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE"
#: Read by the proxy: its API key, and vLLM's (when vLLM has a different one). Environment
#: variables keep secrets out of process listings.
API_KEY_ENV = "HIDDEN_STATE_PROXY_API_KEY"
UPSTREAM_API_KEY_ENV = "HIDDEN_STATE_PROXY_UPSTREAM_API_KEY"


def _add_proxy_options(parser: argparse.ArgumentParser, *, default_host: str) -> None:
    parser.add_argument(
        "--host", default=default_host, help=f"address to bind (default {default_host})"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="proxy port (default 8000)")
    parser.add_argument(
        "--vector-timeout",
        type=float,
        default=DEFAULT_VECTOR_TIMEOUT,
        metavar="SECONDS",
        help="how long a flagged request waits for its vector once vLLM has answered "
        f"(default {DEFAULT_VECTOR_TIMEOUT}); then 504",
    )
    parser.add_argument(
        "--max-body-size",
        type=int,
        default=32 * 1024 * 1024,
        metavar="BYTES",
        help="largest request body accepted; larger bodies get 413 (default 32 MiB)",
    )
    parser.add_argument(
        "--embedding-template",
        default=os.environ.get(EMBEDDING_TEMPLATE_ENV) or DEFAULT_TEMPLATE,
        metavar="TEMPLATE",
        help="/v1/embeddings: prompt template for text inputs, with a {text} placeholder "
        f"(default ${EMBEDDING_TEMPLATE_ENV} or {DEFAULT_TEMPLATE!r})",
    )
    parser.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=2048,
        metavar="N",
        help="/v1/embeddings: most inputs per request; more get 400 (default 2048)",
    )
    parser.add_argument(
        "--fan-out-limit",
        type=int,
        default=64,
        metavar="N",
        help="most vLLM requests one client request keeps in flight (an embeddings input list, "
        "a flagged list of completions prompts; default 64)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"clients must send 'Authorization: Bearer KEY' (default ${API_KEY_ENV}; prefer "
        "the variable: arguments are visible in process listings); /health stays open",
    )
    parser.add_argument(
        "--ring-owner-uid",
        type=int,
        action="append",
        default=None,
        metavar="UID",
        help="trust ring files owned by this user (repeatable; default: the proxy's own user "
        "and root); ring files of other users are refused",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        help="with an API key, /metrics needs it too",
    )
    parser.add_argument(
        "--upstream-api-key",
        default=os.environ.get(UPSTREAM_API_KEY_ENV) or None,
        metavar="KEY",
        help=f"vLLM's own --api-key, if it differs from the proxy's: sent to vLLM instead of "
        f"the client's Authorization header (default ${UPSTREAM_API_KEY_ENV})",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="proxy log level (default info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hidden-state-proxy",
        description="Return a chat model's last hidden state from vLLM, in the same "
        "OpenAI-style call.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="start vLLM (with the worker hook) and the proxy in front of it",
        description="Start vLLM on 127.0.0.1 with the worker hook active, then the proxy. "
        "Options this command does not know are passed to vLLM unchanged "
        "(e.g. --max-model-len 4096 --dtype float16). If either process dies, both stop "
        "and the exit status is non-zero; Ctrl-C stops both.",
    )
    serve.add_argument("model", help="model name or path, as for `vllm serve`")
    _add_proxy_options(serve, default_host="127.0.0.1")
    serve.add_argument(
        "--vllm-port",
        type=int,
        default=DEFAULT_VLLM_PORT,
        help="vLLM port on 127.0.0.1 (default 8001)",
    )
    serve.add_argument(
        "--ring-dir",
        default=None,
        help="shared-memory ring directory (default: a fresh private directory in /dev/shm, "
        "removed at exit)",
    )
    serve.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="give up if vLLM is not healthy after this long (default 1800)",
    )

    proxy = commands.add_parser(
        "proxy",
        allow_abbrev=False,
        help="run the proxy alone, in front of a running vLLM (compose, Helm sidecar)",
        description="Run the proxy alone in front of a vLLM server that has this package "
        "installed (the worker hook) and shares the ring directory.",
    )
    proxy.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="vLLM's base URL, e.g. http://127.0.0.1:8001",
    )
    _add_proxy_options(proxy, default_host="127.0.0.1")
    proxy.add_argument(
        "--ring-dir",
        default=None,
        help=f"shared-memory ring directory (default ${RING_DIR_ENV} or {ring_dir_from_env()})",
    )

    tiny = commands.add_parser(
        "build-tiny-model",
        help="build the tiny offline test model and print its directory",
    )
    tiny.add_argument("path", nargs="?", default=None)
    tiny.add_argument("--force", action="store_true")

    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        help="measure what the proxy costs against vLLM alone (docs/benchmark.md)",
        description="Start the tiny offline stack (or target running servers) and measure "
        "latency, streaming, throughput, memory, the hop alone and the ring; write bench.md and "
        "bench.json.",
    )
    add_bench_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "serve" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("serve", "proxy"):
        try:
            check_template(args.embedding_template)
        except ValueError as problem:
            parser.error(f"--embedding-template: {problem}")
    if args.command == "proxy":
        from .proxy.server import run_proxy
        from .proxy.settings import ProxySettings, default_ring_owners

        settings = ProxySettings(
            upstream_url=args.upstream,
            ring_dir=args.ring_dir or ring_dir_from_env(),
            vector_timeout=args.vector_timeout,
            max_body_bytes=args.max_body_size,
            embedding_template=args.embedding_template,
            max_embedding_inputs=args.max_embedding_inputs,
            fan_out_limit=args.fan_out_limit,
            api_key=args.api_key,
            ring_owner_uids=tuple(args.ring_owner_uid or default_ring_owners()),
            protect_metrics=args.protect_metrics,
            upstream_api_key=args.upstream_api_key,
        )
        run_proxy(settings, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    if args.command == "serve":
        from .serve import serve

        return serve(args, extra)
    if args.command == "build-tiny-model":
        from .tiny_model import build_tiny_model

        print(build_tiny_model(args.path, force=args.force))
        return 0
    if args.command == "bench":
        from .bench.main import run_bench

        return run_bench(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
