"""``extract``'s options: one table (:class:`ExtractOptions`), from which its CLI and the table
in ``docs/extract.md`` are built (a test keeps the docs equal to :func:`options_table`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from vllm_hidden_state_proxy import option_table
from vllm_hidden_state_proxy.option_table import layer_list, option
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, REQUESTED_POOLINGS


def _not_a_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of a float's range: no JSON number")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text, parse_constant=_not_a_json_number, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, not {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text}")
    return value


@dataclass(frozen=True)
class ExtractOptions:
    """``extract``'s options (its positional ``INPUT`` aside)."""

    urls: tuple[str, ...] | None = option(
        None,
        "--url",
        "a proxy, e.g. http://127.0.0.1:8000; repeat it for several (data-parallel or several "
        "nodes: each request goes to the one with the fewest in flight)",
        repeat=True,
        metavar="URL",
        shown_default="required",
    )
    output: str = option(
        "",
        "--output",
        "the dataset's directory (created), or an object store's URI such as s3://bucket/prefix "
        "(the object-store extra)",
        metavar="DIR",
        shown_default="required",
    )
    input_format: str | None = option(
        None,
        "--input-format",
        "how INPUT is read",
        choices=("jsonl", "parquet"),
        shown_default="from INPUT's suffix (.parquet: parquet, else jsonl)",
    )
    layers: tuple[int, ...] | None = option(
        None,
        "--layers",
        "layers to extract, e.g. 0,8,-1 (Transformers' hidden_states indices)",
        metavar="LAYERS",
        parse=layer_list,
        shown_default="every layer the server captures",
    )
    pooling: str = option(
        "last",
        "--pooling",
        "what each layer gives per input: a vector (last, mean, last_answer) or a matrix "
        "(all_prompt, all_answer)",
        choices=REQUESTED_POOLINGS,
    )
    spans: bool = option(
        False,
        "--spans",
        "each input carries `spans` ([start, end) token positions); each layer gives a matrix "
        "of one mean-pooled row per span",
        parse=bool,
    )
    dtype: str = option(
        "float32",
        "--dtype",
        "the values' type, on the wire and in the dataset",
        choices=("float32", "float16"),
    )
    concurrency: int | None = option(
        None,
        "--concurrency",
        "inputs in flight over all URLs (each a ring slot of its proxy, batched or not)",
        metavar="N",
        parse=_positive,
        # Not a guess at vLLM's batch: its default --max-num-seqs depends on the device (1024
        # on a GPU of 70 GiB or more but an A100, 256 on others, 128 per CPU rank), and the
        # proxy does not report it. The proxy's own limit is what it can take: at the default
        # 1024 ring slots, as much as any default batch, the rest waiting in vLLM's queue.
        shown_default="what each proxy's capture description allows: its smallest ring's "
        "slots over --n (1024 by default), half its --max-client-connections (512 of 1024), "
        "for matrices its arena over its largest record; at most fewer than its connections",
    )
    batch_size: int = option(
        32,
        "--batch-size",
        "inputs sent in one request: text or token-id prompts as one completions list, chats "
        "through /v1/chat/completions/batch (one request each where the proxy lacks it); a "
        "batch that fails is split in halves and resent, so one bad input fails alone",
        metavar="N",
        parse=_positive,
    )
    max_tokens: int = option(
        1,
        "--max-tokens",
        "tokens generated per choice (more for last_answer / all_answer)",
        metavar="N",
        parse=int,
    )
    n: int = option(1, "--n", "choices per input (answer poolings: one row each)", parse=_positive)
    extra_body: Mapping[str, Any] | None = option(
        None,
        "--extra-body",
        'JSON merged into every request, e.g. \'{"chat_template_kwargs": '
        '{"enable_thinking": false}}\'',
        metavar="JSON",
        parse=_json_object,
    )
    model: str | None = option(
        None, "--model", "the model name to send", shown_default="the capture description's"
    )
    api_key: str | None = option(
        None, "--api-key", "the proxy's API key, if it has one", env=API_KEY_ENV
    )
    resume: bool = option(
        False,
        "--resume",
        "keep the dataset in DIR and skip the ids it holds (new part files; the same model, "
        "layers, pooling, spans, dtype, --max-tokens, --n and --extra-body, checked against the "
        "manifest and each part)",
        parse=bool,
    )
    retries: int = option(
        5,
        "--retries",
        "retries of one input after 429, 503, 504, a connection error or --timeout "
        "(exponential backoff from 0.5 s, at most 30 s, or the server's Retry-After)",
        metavar="N",
        parse=int,
    )
    timeout: float = option(
        600.0,
        "--timeout",
        "per request, all of it: connecting, waiting in the server's queue, reading the "
        "whole answer (each retry has its own)",
        metavar="SECONDS",
        parse=_positive_seconds,
    )
    max_answer_size: int | None = option(
        None,
        "--max-answer-size",
        "the most bytes of one answer read, counted decoded (gzip); a longer one fails its input",
        metavar="BYTES",
        parse=_positive,
        shown_default="what the request can carry: its vectors in base64 (matrices: the "
        "proxies' largest record each) and 64 MiB of vLLM's answer",
    )
    rows_per_file: int = option(
        100_000, "--rows-per-file", "rows per part file", metavar="N", parse=_positive
    )
    row_group_rows: int = option(
        256,
        "--row-group-rows",
        "rows per Parquet row group: what is buffered before it is written",
        metavar="N",
        parse=_positive,
    )
    progress: bool = option(
        False,
        "--progress",
        "show progress (rate, ETA) on stderr even when it is not a terminal",
        parse=bool,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="a JSONL or Parquet file of inputs, or an object store's URI (s3://bucket/in.jsonl)",
    )
    option_table.add_arguments(parser, ExtractOptions, required=("output",))


def options_table() -> str:
    """The Markdown table of ``extract``'s options (``docs/extract.md`` carries it)."""
    return option_table.markdown_table(spec for _, spec in option_table.options(ExtractOptions))


def options_from_arguments(args: Any) -> ExtractOptions:
    """The parsed command line as :class:`ExtractOptions`; ``ValueError`` for what argparse
    cannot check (a required repeatable ``--url``)."""
    specs = dict(option_table.options(ExtractOptions))
    values = {f.name: getattr(args, f.name) for f in fields(ExtractOptions)}
    if not values["urls"]:
        raise ValueError("the following arguments are required: --url")
    if values["api_key"] is None or values["api_key"] == "":
        values["api_key"] = specs["api_key"].read()
    values["urls"] = tuple(values["urls"])
    for name in ("spans", "resume", "progress"):
        values[name] = bool(values[name])
    return ExtractOptions(**values)
