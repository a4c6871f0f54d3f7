"""``hidden-state-proxy bench`` options: the argparse side and the settled values of a run."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_REQUESTS = 200
DEFAULT_CONCURRENCY = (1, 4, 16, 64)
#: Inputs per ``/v1/embeddings`` request in the embeddings phase.
DEFAULT_EMBEDDING_BATCHES = (1, 16, 256)
#: Embedding inputs per arm and batch size, over all rounds, per latency-arm request.
EMBEDDING_INPUTS_PER_REQUEST = 4
DEFAULT_STREAM_TOKENS = 64
DEFAULT_OUTPUT_DIR = Path("bench-results")
#: --smoke: requests per latency arm, streams per streaming arm, ring operations per size.
SMOKE_REQUESTS = 3
SMOKE_STREAMS = 2
SMOKE_RING_OPS = 200
RING_OPS = 3000
THROUGHPUT_ROUNDS = 6
#: The proxy's own variable for its key (``cli.API_KEY_ENV``): the default of ``--api-key``.
API_KEY_ENV = "HIDDEN_STATE_PROXY_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--proxy-url",
        metavar="URL",
        help="measure this running proxy instead of starting the tiny stack (needs --vllm-url)",
    )
    parser.add_argument(
        "--vllm-url", metavar="URL", help="the vLLM server behind --proxy-url (direct arms)"
    )
    parser.add_argument(
        "--pooling-url",
        metavar="URL",
        help="with --proxy-url: a running vLLM pooling server (--runner pooling, LAST pooling) "
        "of the same model to compare against; without --proxy-url the bench starts one itself",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the tiny offline model is built and cached (default: the user cache)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        help=f"where bench.json, bench.md, bench.png and server logs go (default "
        f"{DEFAULT_OUTPUT_DIR})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help=f"requests per latency arm (default {DEFAULT_REQUESTS}; the other phases scale "
        "with it)",
    )
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, DEFAULT_CONCURRENCY)),
        metavar="LIST",
        help="throughput sweep, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--embedding-batches",
        default=",".join(map(str, DEFAULT_EMBEDDING_BATCHES)),
        metavar="LIST",
        help="inputs per /v1/embeddings request in the embeddings phase, comma-separated "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"send 'Authorization: Bearer KEY' to the proxy (never to vLLM or the pooling "
        f"server); without --proxy-url the bench starts its proxy with this key (default "
        f"${API_KEY_ENV}, as the proxy's own option)",
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=DEFAULT_STREAM_TOKENS,
        metavar="N",
        help="tokens per streamed request (default %(default)s)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds, not minutes: tiny counts, no pooling server, no nginx, no plot",
    )
    parser.add_argument("--no-pooling", action="store_true", help="skip the pooling-server arm")
    parser.add_argument("--no-nginx", action="store_true", help="skip the nginx anchor arm")
    parser.add_argument(
        "--no-embeddings", action="store_true", help="skip the /v1/embeddings phase"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw bench.png")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="give up on a server that is not healthy after this long (default %(default)s)",
    )


@dataclass(frozen=True)
class BenchOptions:
    output_dir: Path
    model_dir: Path | None
    proxy_url: str | None
    vllm_url: str | None
    pooling_url: str | None
    smoke: bool
    #: Per latency arm.
    requests: int
    warmup: int
    #: Per streaming arm.
    streams: int
    stream_tokens: int
    concurrency: tuple[int, ...]
    #: Rounds of the throughput sweep (each arm runs once per round and level); the embeddings
    #: phase takes as many rounds per batch size.
    throughput_rounds: int
    ring_ops: int
    pooling: bool
    nginx: bool
    plot: bool
    startup_timeout: float
    #: Inputs per ``/v1/embeddings`` request, one phase point each; empty: no embeddings phase.
    embedding_batches: tuple[int, ...] = DEFAULT_EMBEDDING_BATCHES
    #: Sent as ``Authorization: Bearer`` to the proxy only.
    api_key: str | None = field(default=None, repr=False)

    @property
    def cpu_requests(self) -> int:
        """Requests per arm of the CPU-time phase."""
        return max(3, self.requests // 2)

    @property
    def targets_running_stack(self) -> bool:
        return self.proxy_url is not None

    def throughput_burst(self, concurrency: int) -> int:
        """Requests per arm in one round at ``concurrency``: every connection used at least
        twice (once in smoke mode), and at least ``requests`` per arm over all rounds. Many
        short rounds interleave the arms finely, so bursts of machine noise hit all of them."""
        if self.smoke:
            return max(concurrency, 2)
        return max(2 * concurrency, -(-self.requests // self.throughput_rounds))

    def embedding_requests(self, batch: int) -> int:
        """``/v1/embeddings`` requests per arm in one round at ``batch`` inputs each: about
        ``EMBEDDING_INPUTS_PER_REQUEST * requests`` inputs over all rounds, at least one
        request a round (smoke: about ``requests`` inputs, one round)."""
        inputs = self.requests if self.smoke else EMBEDDING_INPUTS_PER_REQUEST * self.requests
        return max(1, -(-inputs // (self.throughput_rounds * batch)))

    def public(self) -> dict[str, object]:
        """The options for the report: paths as text, the API key never (only whether set)."""
        found: dict[str, object] = {}
        for key, value in vars(self).items():
            if key == "api_key":
                found[key] = "(set)" if value else None
            else:
                found[key] = str(value) if isinstance(value, Path) else value
        return found


class OptionsError(ValueError):
    pass


def parse_levels(text: str, option: str = "--concurrency") -> tuple[int, ...]:
    """A comma-separated list of positive integers (``option`` names it in errors)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise OptionsError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise OptionsError(f"{option} needs positive integers, got {text!r}")
    return levels


def parse_concurrency(text: str) -> tuple[int, ...]:
    return parse_levels(text, "--concurrency")


def from_args(args: argparse.Namespace) -> BenchOptions:
    if (args.proxy_url is None) != (args.vllm_url is None):
        raise OptionsError("--proxy-url and --vllm-url go together (the direct arms need vLLM)")
    if args.requests is not None and args.requests < 1:
        raise OptionsError("--requests must be at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise OptionsError("--api-key must not be empty")
    if args.stream_tokens < 2:
        raise OptionsError("--stream-tokens must be at least 2 (inter-token latency needs two)")
    smoke = bool(args.smoke)
    requests = args.requests or (SMOKE_REQUESTS if smoke else DEFAULT_REQUESTS)
    target = args.proxy_url is not None
    return BenchOptions(
        output_dir=args.output_dir,
        model_dir=args.model_dir,
        proxy_url=_strip(args.proxy_url),
        vllm_url=_strip(args.vllm_url),
        pooling_url=_strip(args.pooling_url),
        smoke=smoke,
        requests=requests,
        warmup=1 if smoke else 5,
        streams=SMOKE_STREAMS if smoke else max(5, requests // 8),
        stream_tokens=args.stream_tokens,
        concurrency=parse_concurrency(args.concurrency),
        throughput_rounds=1 if smoke else THROUGHPUT_ROUNDS,
        ring_ops=SMOKE_RING_OPS if smoke else RING_OPS,
        pooling=not smoke and not args.no_pooling and (not target or args.pooling_url is not None),
        nginx=not smoke and not args.no_nginx,
        plot=not smoke and not args.no_plot,
        startup_timeout=args.startup_timeout,
        embedding_batches=(
            ()
            if args.no_embeddings
            else parse_levels(args.embedding_batches, "--embedding-batches")
        ),
        api_key=args.api_key,
    )


def _strip(url: str | None) -> str | None:
    return None if url is None else url.rstrip("/")
