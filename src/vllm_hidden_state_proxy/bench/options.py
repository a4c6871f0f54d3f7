"""``hidden-state-proxy bench``'s options: one table (:class:`BenchOptions`), from which its CLI
and the table in ``docs/benchmark.md`` are built, and the counts a run derives from them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from vllm_hidden_state_proxy import option_table
from vllm_hidden_state_proxy.option_table import option
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, UPSTREAM_API_KEY_ENV

#: Each phase (its module in this package) and what it measures, in the order a run goes.
PHASES = {
    "latency": "one-token chats one at a time, straight to vLLM and through the proxy",
    "hop": "the proxy's and vLLM's CPU time per request of those chats",
    "streaming": "time to first token, between tokens and to the last",
    "answers": "16-token chats flagged for each kind of state: answer, matrices, spans",
    "throughput": "requests per second at each --concurrency",
    "embeddings": "the proxy's /v1/embeddings at each --embedding-batches",
    "extract": "extract through serve against vLLM's pooling server, vectors compared; "
    "three vLLM servers one after the other, not in the default",
    "offline": "the offline API's hidden states against vLLM's offline pooling LLM (and the "
    "extract phase's rate, if it ran); three LLMs, not in the default",
}
DEFAULT_PHASES = tuple(name for name in PHASES if name not in ("extract", "offline"))
DEFAULT_REQUESTS, SMOKE_REQUESTS, SMOKE_STREAMS, ROUNDS = 200, 3, 2, 6
#: Embedding inputs per arm and batch size, over all rounds, per latency-arm request.
EMBEDDING_INPUTS_PER_REQUEST = 4
#: The extract comparison's corpus, and its rounds (each arm sends the whole corpus a round).
EXTRACT_INPUTS, SMOKE_EXTRACT_INPUTS, EXTRACT_ROUNDS = 400, 16, 3
#: Requests per arm of the CPU-time phase, at least (the proxy's share must be many ticks).
MIN_CPU_REQUESTS = 50


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return int(text)


def _levels(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers."""
    return tuple(_positive(part) for part in text.split(",") if part.strip()) or (_positive(text),)


def _phases(text: str) -> tuple[str, ...]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or set(names) - set(PHASES):
        raise argparse.ArgumentTypeError(f"{text!r}: the phases are {', '.join(PHASES)}")
    return tuple(name for name in PHASES if name in names)  # in a run's order


def _tokens(text: str) -> int:
    if _positive(text) < 2:
        raise argparse.ArgumentTypeError("at least 2: inter-token latency needs two")
    return int(text)


def _key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty key")
    return text


@dataclass(frozen=True)
class BenchOptions:
    """``bench``'s options; :func:`from_args` settles the defaults that ``--smoke`` changes."""

    phases: tuple[str, ...] = option(
        DEFAULT_PHASES,
        "--phases",
        "the phases to run, comma-separated: "
        + "; ".join(f"{name} ({what})" for name, what in PHASES.items()),
        parse=_phases,
        metavar="LIST",
        shown_default=",".join(DEFAULT_PHASES),
    )
    proxy_url: str | None = option(None, "--proxy-url", "measure this running proxy", metavar="URL")
    vllm_url: str | None = option(None, "--vllm-url", "the vLLM behind --proxy-url", metavar="URL")
    api_key: str | None = option(
        None, "--api-key", "sent to the proxy only; the proxy the bench starts requires it",
        parse=_key, metavar="KEY", env=API_KEY_ENV, secret=True,
    )  # fmt: skip
    vllm_api_key: str | None = option(
        None, "--vllm-api-key", "vLLM's own key, sent by the direct arms to --vllm-url only",
        parse=_key, metavar="KEY", env=UPSTREAM_API_KEY_ENV, secret=True,
    )  # fmt: skip
    smoke: bool = option(False, "--smoke", "seconds, not minutes: tiny counts", parse=bool)
    requests: int = option(
        0, "--requests", "per latency arm; the other phases' counts follow it", parse=_positive,
        metavar="N", shown_default=f"{DEFAULT_REQUESTS}; --smoke: {SMOKE_REQUESTS}",
    )  # fmt: skip
    concurrency: tuple[int, ...] = option(
        (1, 4, 16, 64), "--concurrency", "throughput's levels", parse=_levels, metavar="LIST",
        shown_default="1,4,16,64",
    )  # fmt: skip
    embedding_batches: tuple[int, ...] = option(
        (1, 16, 256), "--embedding-batches", "inputs per /v1/embeddings request", parse=_levels,
        metavar="LIST", shown_default="1,16,256",
    )  # fmt: skip
    stream_tokens: int = option(64, "--stream-tokens", "per stream", parse=_tokens, metavar="N")
    extract_inputs: int = option(
        0, "--extract-inputs", "the extract comparison's corpus", parse=_positive, metavar="N",
        shown_default=f"{EXTRACT_INPUTS}; --smoke: {SMOKE_EXTRACT_INPUTS}",
    )  # fmt: skip
    extract_concurrency: int | None = option(
        None, "--extract-concurrency", "requests in flight in every arm of the extract phase",
        parse=_positive, metavar="N", shown_default="extract's own against the bench's proxy",
    )  # fmt: skip
    model_dir: Path | None = option(
        None, "--model-dir", "the tiny model's cache", parse=Path, metavar="DIR"
    )
    output_dir: Path = option(
        Path("bench-results"), "--output-dir", "the reports", parse=Path, metavar="DIR"
    )
    startup_timeout: float = option(
        600.0, "--startup-timeout", "per server", parse=float, metavar="SECONDS"
    )

    @property
    def rounds(self) -> int:
        """Rounds of the phases whose arms take turns burst by burst."""
        return 1 if self.smoke else ROUNDS

    @property
    def warmup(self) -> int:
        return 1 if self.smoke else 5

    @property
    def streams(self) -> int:
        return SMOKE_STREAMS if self.smoke else max(5, self.requests // 8)

    @property
    def cpu_requests(self) -> int:
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
        """The options for the report: paths as text, the API keys never (only whether set)."""
        found = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()}
        return {
            **found,
            "api_key": self.api_key and "(set)",
            "vllm_api_key": self.vllm_api_key and "(set)",
        }


class OptionsError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    option_table.add_arguments(parser, BenchOptions)


def options_table() -> str:
    """The Markdown table of ``bench``'s options (``docs/benchmark.md`` carries it)."""
    return option_table.markdown_table(spec for _, spec in option_table.options(BenchOptions))


def from_args(args: argparse.Namespace) -> BenchOptions:
    """The options of a parsed command line, defaults settled; :class:`OptionsError` for a
    combination that cannot run."""
    given = BenchOptions(
        **{name: getattr(args, name) for name, _ in option_table.options(BenchOptions)}
    )
    if (given.proxy_url is None) != (given.vllm_url is None):
        raise OptionsError("--proxy-url and --vllm-url go together (the direct arms need vLLM)")
    if {"extract", "offline"} & set(given.phases) and given.proxy_url is not None:
        raise OptionsError("extract and offline start their own servers: leave --proxy-url out")
    smoke = given.smoke
    return dataclasses.replace(
        given,
        proxy_url=given.proxy_url and given.proxy_url.rstrip("/"),
        vllm_url=given.vllm_url and given.vllm_url.rstrip("/"),
        requests=given.requests or (SMOKE_REQUESTS if smoke else DEFAULT_REQUESTS),
        extract_inputs=given.extract_inputs or (SMOKE_EXTRACT_INPUTS if smoke else EXTRACT_INPUTS),
    )
