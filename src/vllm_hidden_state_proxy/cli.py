"""Command line: ``hidden-state-proxy serve|proxy|check|build-tiny-model|bench``.

The proxy's options come from its settings table (``proxy/settings.py``); ``serve`` adds the
few that concern vLLM and the pair of processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from vllm_hidden_state_proxy.bench.options import add_arguments as add_bench_arguments
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, LAYERS_ENV, layer_indices
from vllm_hidden_state_proxy.proxy import settings as proxy_settings

#: Proxy settings that ``serve`` decides itself: how the proxy reaches vLLM (its address and
#: key), and its own ``--ring-dir`` and ``--upstream-api-key``.
SERVE_DECIDES = ("upstream_url", "upstream_uds", "upstream_api_key", "ring_dir")


def layer_list(text: str) -> tuple[int, ...]:
    """``--hidden-state-layers``: comma-separated layer indices, e.g. ``4,8,-1``."""
    try:
        layers = layer_indices(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 4,8,-1, not {text!r}"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hidden-state-proxy",
        description="Return a chat model's hidden states from vLLM, in the same OpenAI-style call.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="start vLLM (with the worker hook) and the proxy in front of it",
        description="Start vLLM with the worker hook active, reachable only by the proxy "
        "(a private Unix socket and a random API key), then the proxy. "
        "Options this command does not know are passed to vLLM unchanged "
        "(e.g. --max-model-len 4096 --dtype float16). If either process dies, both stop "
        "and the exit status is non-zero; Ctrl-C stops both.",
    )
    serve.add_argument("model", help="model name or path, as for `vllm serve`")
    proxy_settings.add_arguments(serve, skip=SERVE_DECIDES)
    serve.add_argument(
        "--vllm-port",
        type=int,
        default=None,
        metavar="PORT",
        help="let vLLM listen on 127.0.0.1:PORT instead of a private Unix socket, for tools "
        "that must reach it directly; every local user can then connect to it: vLLM's key "
        "guards only /v1 and a few other paths, not e.g. /invocations or /tokenize "
        "(default: no TCP port)",
    )
    # The proxy's option, with what it means under serve (which also starts vLLM with it).
    key = {f.name: spec for f, spec in proxy_settings.options()}["upstream_api_key"]
    chosen_key = os.environ.get(key.env) if key.env else None
    serve.add_argument(
        key.flag,
        dest="upstream_api_key",
        default=chosen_key or None,
        metavar=key.metavar,
        help="the key serve starts vLLM with (as VLLM_API_KEY, never on its command line) and "
        "the proxy sends it; set it only for tools that must reach vLLM directly "
        f"(default ${key.env} or a fresh random key)",
    )
    serve.add_argument(
        "--ring-dir",
        default=None,
        metavar="DIR",
        help="shared-memory ring directory (default: a fresh private directory in /dev/shm, "
        "removed at exit)",
    )
    serve.add_argument(
        "--hidden-state-layers",
        type=layer_list,
        default=None,
        metavar="LAYERS",
        help="layers the worker hook captures, e.g. 4,8,-1 (Transformers' hidden_states "
        f"indices; -1 is the final layer after the final norm). Sets {LAYERS_ENV} for vLLM. "
        "Default: the final layer only",
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
    proxy_settings.add_arguments(proxy, required=("upstream_url",))

    check = commands.add_parser(
        "check",
        allow_abbrev=False,
        help="prove a running deployment returns hidden states, or name the fix",
        description="Ask a running proxy for its health, vLLM's version, the engines' hooks "
        "and captured layers, then send an ordinary request and flagged ones (every captured "
        "layer, mean pooling, streamed) and check each vector's size and finiteness. Exits 1 "
        "with one sentence naming the fix at the first failure.",
    )
    check.add_argument("--url", required=True, help="the proxy, e.g. http://127.0.0.1:8000")
    check.add_argument(
        "--api-key",
        default=None,
        help=f"the proxy's API key, if it has one (default: ${API_KEY_ENV})",
    )
    check.add_argument(
        "--model", default=None, help="the model name to send (default: the first of /v1/models)"
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="per request (default 120)",
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
    )
    add_bench_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "serve" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("serve", "proxy"):
        overrides = {"upstream_url": "http://127.0.0.1", "ring_dir": "/"}
        try:  # check the proxy's options before anything starts
            proxy_settings.from_arguments(
                args, **{k: v for k, v in overrides.items() if args.command == "serve"}
            )
        except ValueError as problem:
            parser.error(str(problem))
    if args.command == "proxy":
        from vllm_hidden_state_proxy.proxy.server import serve_proxy

        serve_proxy(proxy_settings.from_arguments(args))
        return 0
    if args.command == "serve":
        from vllm_hidden_state_proxy.serve import serve

        return serve(args, extra)
    if args.command == "check":
        from vllm_hidden_state_proxy.check import run_check

        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        return run_check(args.url, api_key, args.model, args.timeout)
    if args.command == "build-tiny-model":
        from vllm_hidden_state_proxy.tiny_model import build_tiny_model

        print(build_tiny_model(args.path, force=args.force))
        return 0
    if args.command == "bench":
        from vllm_hidden_state_proxy.bench.main import run_bench

        return run_bench(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
