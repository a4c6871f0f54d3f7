"""Command line: ``hidden-state-proxy serve|proxy|check|extract|build-tiny-model|bench``.

Each command's options come from a table: the proxy's settings (``proxy/settings.py``),
``serve``'s own (``serve_options.py``, on top of the proxy's), ``check``'s
(:class:`CheckOptions`), ``extract``'s (``extract/options.py``) and the benchmark's
(``bench/options.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hidden_state_proxy import __version__, option_table, serve_options, tiny_model
from vllm_hidden_state_proxy.bench.options import add_arguments as add_bench_arguments
from vllm_hidden_state_proxy.extract import options as extract_options
from vllm_hidden_state_proxy.option_table import option
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, TINY_MODEL_DIR_ENV, VLLM_API_KEY_ENV
from vllm_hidden_state_proxy.proxy import settings as proxy_settings


@dataclass(frozen=True)
class CheckOptions:
    """``check``'s options."""

    url: str = option(
        "", "--url", "the proxy, e.g. http://127.0.0.1:8000", shown_default="required"
    )
    api_key: str | None = option(
        None,
        "--api-key",
        "the proxy's API key, if it has one",
        env=API_KEY_ENV,
        fallback_env=(VLLM_API_KEY_ENV,),
    )
    model: str | None = option(
        None, "--model", "the model name to send", shown_default="the first of /v1/models"
    )
    timeout: float = option(120.0, "--timeout", "per request", metavar="SECONDS", parse=float)


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"hidden-state-proxy {__version__}")


def normalise_flags(argv: Sequence[str], known: set[str]) -> list[str]:
    """``argv`` with vLLM's other spelling of each option in ``known`` (``--api_key`` for
    ``--api-key``, also as ``--api_key=K``) rewritten to ours; everything else unchanged (vLLM
    reads both spellings of its own options), and nothing after a bare ``--``."""
    result: list[str] = []
    for position, arg in enumerate(argv):
        if arg == "--":
            return result + list(argv[position:])
        name, equals, value = arg.partition("=")
        if name.startswith("--") and "_" in name and name.replace("_", "-") in known:
            arg = name.replace("_", "-") + equals + value
        result.append(arg)
    return result


class TwoModels(ValueError):
    """``serve A --model B``."""


def model_first(argv: Sequence[str]) -> list[str]:
    """``serve``'s arguments (``argv[0]`` is ``serve``) with vLLM's ``--model M`` (or
    ``--model=M``) turned into the model argument, first, as ``serve M`` takes it; unchanged
    without ``--model``. Done before parsing: a model given as an option leaves no positional,
    and argparse would take the value of the first option it does not know (``--dtype
    float16``) for it. :class:`TwoModels` if a model is given twice, differently."""
    rest: list[str] = []
    models: list[str] = []
    position = 1
    while position < len(argv):
        arg = argv[position]
        if arg == "--":
            rest += argv[position:]
            break
        if arg == "--model" and position + 1 < len(argv):
            models.append(argv[position + 1])
            position += 2
            continue
        if arg.startswith("--model="):
            models.append(arg.removeprefix("--model="))
        else:
            rest.append(arg)
        position += 1
    if not models:
        return list(argv)
    if rest and not rest[0].startswith("-"):  # vLLM's positional model, too
        models.append(rest.pop(0))
    if len(set(models)) > 1:
        raise TwoModels(f"two models: {' and '.join(map(repr, dict.fromkeys(models)))}")
    return [argv[0], models[0], *rest]


def _normalised(argv: Sequence[str]) -> list[str]:
    """``argv`` with the options of ``serve`` or ``proxy`` (its first word) normalised."""
    if argv and argv[0] == "serve":
        return model_first(normalise_flags(argv, serve_options.flags()))
    if argv and argv[0] == "proxy":
        flags = {spec.flag for _, spec in proxy_settings.options() if spec.flag is not None}
        return normalise_flags(argv, flags)
    return list(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hidden-state-proxy",
        description="Return a chat model's hidden states from vLLM, in the same OpenAI-style call.",
    )
    _add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="start vLLM (with the worker hook) and the proxy in front of it",
        description="Start vLLM with the worker hook active, reachable only by the proxy "
        "(a private Unix socket and a random API key), then the proxy. "
        "Options this command does not know are passed to vLLM unchanged "
        "(e.g. --max-model-len 4096 --dtype float16); options are understood in vLLM's "
        "spellings too (--api_key as --api-key). If either process dies, both stop "
        "and the exit status is non-zero; Ctrl-C stops both.",
    )
    serve.add_argument(
        "model",
        nargs="?",
        help="model name or path, as for `vllm serve` (or as vLLM's --model MODEL)",
    )
    serve_options.add_arguments(serve)

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
    option_table.add_arguments(check, CheckOptions, required=("url",))

    extract = commands.add_parser(
        "extract",
        allow_abbrev=False,
        help="a corpus (JSONL or Parquet) in, a Parquet dataset of hidden states out",
        description="Send every input of INPUT (an `id` and `messages` or `prompt` per line or "
        "row) to the proxies with bounded concurrency and write one Parquet row per input and "
        "choice, a manifest and an errors file to --output (docs/extract.md). Exits 0 when "
        "every input was written, 1 when some failed (_errors.jsonl says why), 3 when an error no "
        "input explains stopped it, 130 on Ctrl-C (the dataset stays whole: --resume finishes "
        "it). Needs pyarrow (the extract extra).",
    )
    extract_options.add_arguments(extract)

    tiny = commands.add_parser(
        "build-tiny-model",
        help="build the tiny offline test model and print its directory",
        description=f"Build the built-in tiny chat model ({tiny_model.DESCRIPTION}, float32; a "
        "ChatML template; no model hub, a few seconds) and print its directory; a build that is "
        "already there and current is reused. "
        "`serve --tiny-model` serves it; a command that starts vLLM itself takes the printed "
        "directory as its model.",
    )
    tiny.add_argument(
        "path",
        nargs="?",
        default=None,
        help=f"where to build it (default ${TINY_MODEL_DIR_ENV} or "
        f"{tiny_model.DEFAULT_TINY_MODEL_DIR})",
    )
    tiny.add_argument(
        "--force", action="store_true", help="build it again even if a current build is there"
    )

    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        help="measure what the proxy costs against vLLM alone (docs/benchmark.md)",
    )
    add_bench_arguments(bench)
    for command in (serve, proxy, check, extract, tiny, bench):
        _add_version(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        arguments = _normalised(sys.argv[1:] if argv is None else argv)
    except TwoModels as problem:
        parser.error(str(problem))
    args, extra = parser.parse_known_args(arguments)
    if args.command != "serve" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve" and args.model is None and not args.tiny_model:
        parser.error("serve needs a model: serve MODEL (or serve --model MODEL, or --tiny-model)")
    if args.command in ("serve", "proxy"):
        overrides = {"upstream_url": "http://127.0.0.1", "ring_dir": "/"}
        try:  # check the proxy's options before anything starts
            settings = proxy_settings.from_arguments(
                args, **{k: v for k, v in overrides.items() if args.command == "serve"}
            )
        except ValueError as problem:
            parser.error(str(problem))
        args.host = settings.host  # its default follows the API key
        exposure = settings.exposure_problem
        if exposure is not None and args.command == "serve":
            parser.error(exposure)
        if exposure is not None:  # the proxy in a container: its network may be the boundary
            print(f"[hidden-state-proxy] WARNING: {exposure}", file=sys.stderr, flush=True)
    if args.command == "proxy":
        from vllm_hidden_state_proxy.proxy.server import serve_proxy

        serve_proxy(proxy_settings.from_arguments(args))
        return 0
    if args.command == "serve":
        from vllm_hidden_state_proxy.serve import serve

        return serve(args, extra)
    if args.command == "check":
        from vllm_hidden_state_proxy.check import run_check

        # An empty --api-key falls back to the variable, as no --api-key does.
        key_option = dict(option_table.options(CheckOptions))["api_key"]
        return run_check(args.url, args.api_key or key_option.read(), args.model, args.timeout)
    if args.command == "extract":
        from vllm_hidden_state_proxy.extract.options import options_from_arguments
        from vllm_hidden_state_proxy.extract.runner import run_extract

        try:
            options = options_from_arguments(args)
        except ValueError as problem:
            parser.error(str(problem))
        return run_extract(args.input, options, command_line=sys.argv)
    if args.command == "build-tiny-model":
        print(tiny_model.build_tiny_model(args.path, force=args.force))
        return 0
    if args.command == "bench":
        from vllm_hidden_state_proxy.bench.main import run_bench

        return run_bench(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
