"""``extract``'s options: one table (:class:`ExtractOptions`), from which its CLI and the table
in ``docs/extract.md`` are built (a test keeps the docs equal to :func:`options_table`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy import option_table
from vllm_hidden_state_proxy.option_table import option
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, REQUESTED_POOLINGS, layer_indices


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = layer_indices(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 0,8,-1, not {text!r}"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
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
        "", "--output", "the dataset's directory (created)", metavar="DIR", shown_default="required"
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
        parse=_layers,
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
        "requests in flight over all URLs",
        metavar="N",
        parse=_positive,
        # Not a guess at vLLM's batch: its default --max-num-seqs depends on the device (1024
        # on a GPU of 70 GiB or more but an A100, 256 on others, 128 per CPU rank), and the
        # proxy does not report it. The proxy's own limit is what it can take: at the default
        # 1024 ring slots, as much as any default batch, the rest waiting in vLLM's queue.
        shown_default="what each proxy's capture description allows: its smallest ring's "
        "slots over --n (1024 by default), for matrices its arena over its largest record",
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
        "layers, pooling and dtype)",
        parse=bool,
    )
    retries: int = option(
        5,
        "--retries",
        "retries of one input after 429, 503, 504 or a connection error (exponential backoff "
        "from 0.5 s, at most 30 s, or the server's Retry-After)",
        metavar="N",
        parse=int,
    )
    timeout: float = option(600.0, "--timeout", "per request", metavar="SECONDS", parse=float)
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
    parser.add_argument("input", metavar="INPUT", help="a JSONL or Parquet file of inputs")
    option_table.add_arguments(parser, ExtractOptions, required=("output",))


def options_table() -> str:
    """The Markdown table of ``extract``'s options (``docs/extract.md`` carries it)."""
    return option_table.markdown_table(spec for _, spec in option_table.options(ExtractOptions))
