"""``hidden-state-proxy bench`` options: the argparse side and the settled values of a run."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hidden_state_proxy.protocol import API_KEY_ENV, UPSTREAM_API_KEY_ENV

DEFAULT_REQUESTS = 200
#: Embedding inputs per arm and batch size, over all rounds, per latency-arm request.
EMBEDDING_INPUTS_PER_REQUEST = 4
#: --smoke: requests per latency arm, streams per streaming arm.
SMOKE_REQUESTS, SMOKE_STREAMS = 3, 2
ROUNDS = 6
#: The extract comparison (issue #38): inputs of its corpus, and its rounds (each arm sends
#: the whole corpus once a round).
EXTRACT_INPUTS, SMOKE_EXTRACT_INPUTS, EXTRACT_ROUNDS = 400, 16, 3
#: Requests per arm of the CPU-time phase, at least (the proxy's share must be many ticks).
MIN_CPU_REQUESTS = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--proxy-url", metavar="URL", help="measure this running proxy (needs --vllm-url)")
    add("--vllm-url", metavar="URL", help="the vLLM server behind --proxy-url")
    add("--model-dir", type=Path, help="where the tiny offline model is built and cached")
    add("--output-dir", type=Path, default=Path("bench-results"), help="default %(default)s")
    add("--requests", type=int, metavar="N", help=f"per latency arm (default {DEFAULT_REQUESTS})")
    add("--concurrency", default="1,4,16,64", metavar="LIST", help="default %(default)s")
    add("--embedding-batches", default="1,16,256", metavar="LIST", help="default %(default)s")
    add(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"for the proxy only, also the one the bench starts (default ${API_KEY_ENV})",
    )
    add(
        "--vllm-api-key",
        default=os.environ.get(UPSTREAM_API_KEY_ENV) or None,
        metavar="KEY",
        help="vLLM's own key, for the direct arms against --vllm-url (serve's vLLM has one: "
        f"its --upstream-api-key) (default ${UPSTREAM_API_KEY_ENV})",
    )
    add("--stream-tokens", type=int, default=64, metavar="N", help="default %(default)s")
    add("--smoke", action="store_true", help="seconds, not minutes: tiny counts")
    add("--no-embeddings", action="store_true", help="skip the /v1/embeddings phase")
    add(
        "--extract-compare",
        action="store_true",
        help="add the extract comparison: extract through the proxy, vLLM's pooling server, a "
        "Transformers loop (starts three vLLM servers, one after the other)",
    )
    add("--extract-compare-only", action="store_true", help="run the extract comparison alone")
    add(
        "--extract-inputs",
        type=int,
        metavar="N",
        help=f"the extract comparison's corpus (default {EXTRACT_INPUTS}; smoke "
        f"{SMOKE_EXTRACT_INPUTS})",
    )
    add(
        "--extract-concurrency",
        type=int,
        metavar="N",
        help="requests in flight in every arm of the extract comparison (default: extract's own "
        "default against the proxy)",
    )
    add("--startup-timeout", type=float, default=600.0, metavar="SECONDS")


@dataclass(frozen=True)
class BenchOptions:
    output_dir: Path
    model_dir: Path | None
    proxy_url: str | None
    vllm_url: str | None
    smoke: bool
    #: Per latency arm.
    requests: int
    warmup: int
    #: Per streaming arm.
    streams: int
    stream_tokens: int
    concurrency: tuple[int, ...]
    #: Rounds of the phases whose arms take turns burst by burst.
    rounds: int
    startup_timeout: float
    #: Inputs per ``/v1/embeddings`` request, one phase point each; empty: no embeddings phase.
    embedding_batches: tuple[int, ...]
    #: The extract comparison's corpus; 0: no comparison.
    extract_inputs: int = 0
    #: Only the extract comparison.
    extract_only: bool = False
    #: Its requests in flight (None: extract's default).
    extract_concurrency: int | None = None
    #: Sent as ``Authorization: Bearer`` to the proxy only.
    api_key: str | None = field(default=None, repr=False)
    #: Sent as ``Authorization: Bearer`` to ``vllm_url`` only (the direct arms).
    vllm_api_key: str | None = field(default=None, repr=False)

    @property
    def cpu_requests(self) -> int:
        """Requests per arm of the CPU-time phase."""
        return max(MIN_CPU_REQUESTS, self.requests // 2)

    def throughput_burst(self, concurrency: int) -> int:
        """Requests per arm in one round at ``concurrency``: every connection used at least
        twice (once in smoke mode), and at least ``requests`` per arm over all rounds."""
        if self.smoke:
            return max(concurrency, 2)
        return max(2 * concurrency, -(-self.requests // self.rounds))

    def embedding_requests(self, batch: int) -> int:
        """Requests per arm in one round at ``batch`` inputs each: about
        ``EMBEDDING_INPUTS_PER_REQUEST * requests`` inputs over all rounds (smoke: about
        ``requests``), at least one a round."""
        inputs = self.requests if self.smoke else EMBEDDING_INPUTS_PER_REQUEST * self.requests
        return max(1, -(-inputs // (self.rounds * batch)))

    def public(self) -> dict[str, object]:
        """The options for the report: paths as text, the API key never (only whether set)."""
        found: dict[str, object] = {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()
        }
        found["api_key"] = "(set)" if self.api_key else None
        found["vllm_api_key"] = "(set)" if self.vllm_api_key else None
        return found


class OptionsError(ValueError):
    pass


def parse_levels(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``option`` names it in errors)."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise OptionsError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise OptionsError(f"{option} needs positive integers, got {text!r}")
    return levels


def from_args(args: argparse.Namespace) -> BenchOptions:
    if (args.proxy_url is None) != (args.vllm_url is None):
        raise OptionsError("--proxy-url and --vllm-url go together (the direct arms need vLLM)")
    if args.requests is not None and args.requests < 1:
        raise OptionsError("--requests must be at least 1")
    for key, option in ((args.api_key, "--api-key"), (args.vllm_api_key, "--vllm-api-key")):
        if key is not None and not key.strip():
            raise OptionsError(f"{option} must not be empty")
    if args.stream_tokens < 2:
        raise OptionsError("--stream-tokens must be at least 2 (inter-token latency needs two)")
    smoke = bool(args.smoke)
    requests = args.requests or (SMOKE_REQUESTS if smoke else DEFAULT_REQUESTS)
    rounds = 1 if smoke else ROUNDS
    batches = (
        () if args.no_embeddings else parse_levels(args.embedding_batches, "--embedding-batches")
    )
    extract_wanted = bool(args.extract_compare or args.extract_compare_only)
    if extract_wanted and args.proxy_url is not None:
        raise OptionsError("the extract comparison starts its own servers: leave --proxy-url out")
    for value, option in ((args.extract_inputs, "--extract-inputs"),
                          (args.extract_concurrency, "--extract-concurrency")):  # fmt: skip
        if value is not None and value < 1:
            raise OptionsError(f"{option} must be at least 1")
    extract_inputs = args.extract_inputs or (SMOKE_EXTRACT_INPUTS if smoke else EXTRACT_INPUTS)
    return BenchOptions(
        output_dir=args.output_dir,
        model_dir=args.model_dir,
        proxy_url=None if args.proxy_url is None else args.proxy_url.rstrip("/"),
        vllm_url=None if args.vllm_url is None else args.vllm_url.rstrip("/"),
        smoke=smoke,
        requests=requests,
        warmup=1 if smoke else 5,
        streams=SMOKE_STREAMS if smoke else max(5, requests // 8),
        stream_tokens=args.stream_tokens,
        concurrency=parse_levels(args.concurrency, "--concurrency"),
        rounds=rounds,
        startup_timeout=args.startup_timeout,
        embedding_batches=batches,
        extract_inputs=extract_inputs if extract_wanted else 0,
        extract_only=bool(args.extract_compare_only),
        extract_concurrency=args.extract_concurrency,
        api_key=args.api_key,
        vllm_api_key=args.vllm_api_key,
    )
