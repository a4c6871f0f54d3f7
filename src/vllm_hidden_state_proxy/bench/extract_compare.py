"""Vectors per second and memory of three ways to turn a corpus into hidden states (issue #38),
on one corpus of token-id prompts (no chat template: all three see the very same tokens):

1. ``extract`` (its runner, called as a library) through the proxy of one generation server
   (``hidden-state-proxy serve``), ``last`` and ``mean`` pooling of the final layer;
2. vLLM's pooling server (``--runner pooling --convert embed``, LAST or MEAN pooling, no
   normalisation), one server per pooling, sent the same inputs through ``/v1/embeddings`` at
   the same concurrency (one input a request, and 32 a request: how one would batch it);
3. a Transformers batched loop (:mod:`.transformers_loop`, its own process), at the fastest
   of a few batch sizes.

The vectors of 1 and 2 are compared with the loop's unpadded batch-1 vectors (the e2e tests'
reference) by id. Beside ``extract``, the generation server's side of the gap is taken apart
(same inputs, same concurrency): vLLM's one-token generation alone (direct, unflagged), the
proxy's hop (unflagged through the proxy), the capture and ring (flagged through the proxy, a
bare httpx client), and ``extract``'s own client side (``extract`` against that).

Only one vLLM runs at a time (the caller holds the machine-wide lock): the generation stack,
then the LAST pooling server, then the MEAN one. Arms of one server take turns in rounds
(:func:`~.turns.round_robin`); a rate is the median over rounds of one whole corpus's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.servers import (
    SERVED_MODEL_NAME,
    VLLM_ARGS,
    chat_stack,
    started,
)
from vllm_hidden_state_proxy.bench.turns import round_robin
from vllm_hidden_state_proxy.bench.usage import PeakRss
from vllm_hidden_state_proxy.processes import free_port, offline_environment, vllm_command
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV

POOLINGS = ("last", "mean")
#: Acceptance thresholds in float32, as the e2e tests' (tests/e2e/reference.py, issue #2).
MIN_COSINE = 0.9999
MAX_RELATIVE_L2 = 1e-3
#: The pooling server's inputs per request in its batched arm (in flight: the concurrency over
#: this, so that as many inputs are in flight as in every other arm).
POOLING_BATCH = 32
TRANSFORMERS_BATCH_SIZES = (1, 8, 32, 128)
SMOKE_TRANSFORMERS_BATCH_SIZES = (1, 8)
TITLE = "Extract: a corpus to vectors, three ways"
PARTS_TITLE = "Extract: where the generation server's time goes (last pooling)"
MEMORY_TITLE = "Extract: peak resident memory"
EXTRACT = "extract -> proxy -> generation vLLM"
POOLING_ONE = "pooling server, 1 input a request"
POOLING_MANY = f"pooling server, {POOLING_BATCH} inputs a request"
TRANSFORMERS = "Transformers loop"
#: Words the corpus' texts are drawn from (the tiny tokenizer was trained on such text).
_TEXT = (
    "the model reads a prompt and computes a state at every position researchers use hidden "
    "states for retrieval clustering probes and interpretability rivers mountains cities red "
    "blue green one two three what is the capital of france paris summarize this text"
)
_WORDS = _TEXT.split(" ")


@dataclass(frozen=True)
class Item:
    id: str
    tokens: list[int]


def make_corpus(tokenizer: Any, count: int) -> list[Item]:
    """``count`` distinct texts of 4 to 80 words (so 5 to ~100 tokens), as token ids (no
    special tokens: every method sees exactly these)."""
    items = []
    for number in range(count):
        length = 4 + (number * 37) % 77
        words = [_WORDS[(number * 7 + k * 13 + k * k) % len(_WORDS)] for k in range(length)]
        text = f"Input {number}: " + " ".join(words) + "."
        tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        items.append(Item(f"in-{number}", tokens))
    return items


def write_inputs(path: Path, corpus: Sequence[Item]) -> None:
    """``extract``'s JSONL: one ``{"id", "prompt": [token ids]}`` per line."""
    with path.open("w", encoding="utf-8") as out:
        for item in corpus:
            out.write(json.dumps({"id": item.id, "prompt": item.tokens}) + "\n")


# -- agreement -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """How a method's vectors compare with the reference's, paired by id."""

    compared: int
    #: Reference ids the method has no vector for, and ids it has that the reference has not.
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    min_cosine: float = 1.0
    max_relative_l2: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.compared > 0
            and not self.missing
            and not self.unexpected
            and self.min_cosine >= MIN_COSINE
            and self.max_relative_l2 <= MAX_RELATIVE_L2
        )

    def cell(self) -> str:
        text = f"cos >= {self.min_cosine:.7f}, rel L2 <= {self.max_relative_l2:.1e}"
        if self.missing or self.unexpected:
            text += f"; {len(self.missing)} missing, {len(self.unexpected)} unexpected"
        return ("yes: " if self.ok else "**NO**: ") + text


def agreement(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> Agreement:
    """Each of ``expected``'s vectors against ``actual``'s of the same id: the worst cosine
    and relative L2 error (in float64), and the ids either side lacks."""
    missing = tuple(sorted(set(expected) - set(actual)))
    unexpected = tuple(sorted(set(actual) - set(expected)))
    cosines, errors = [], []
    for key in sorted(set(expected) & set(actual)):
        a = np.asarray(actual[key], dtype=np.float64).ravel()
        e = np.asarray(expected[key], dtype=np.float64).ravel()
        if a.shape != e.shape:
            cosines.append(0.0)
            errors.append(float("inf"))
            continue
        norm_a, norm_e = float(np.linalg.norm(a)), float(np.linalg.norm(e))
        difference = float(np.linalg.norm(a - e))
        if norm_e == 0.0:
            cosines.append(1.0 if norm_a == 0.0 else 0.0)
            errors.append(0.0 if norm_a == 0.0 else float("inf"))
            continue
        cosines.append(float(a @ e) / (norm_a * norm_e) if norm_a else 0.0)
        errors.append(difference / norm_e)
    return Agreement(
        len(cosines),
        missing,
        unexpected,
        min(cosines, default=1.0),
        max(errors, default=0.0),
    )


def by_id(ids: Sequence[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Rows paired with their ids; a repeated id is an error, not a quiet overwrite."""
    if len(ids) != len(rows):
        raise BenchError(f"{len(ids)} ids for {len(rows)} vectors")
    paired = dict(zip(ids, rows, strict=True))
    if len(paired) != len(ids):
        raise BenchError(f"{len(ids) - len(paired)} ids repeated among the vectors")
    return paired


def read_extract_dataset(directory: Path) -> dict[str, np.ndarray]:
    """The final-layer vectors of an ``extract`` dataset, by id (its manifest names the
    column; its ``choice`` must be 0 everywhere: one row per input)."""
    import pyarrow.parquet as pq

    from vllm_hidden_state_proxy.extract.dataset import column_name, part_files, read_manifest

    manifest = read_manifest(directory)
    if manifest is None:
        raise BenchError(f"{directory}: no manifest: extract did not finish")
    (layer,) = manifest["layers"]
    column = column_name(int(layer))
    ids: list[str] = []
    rows: list[np.ndarray] = []
    for part in part_files(directory):
        table = pq.read_table(part, columns=["id", "choice", column])
        if any(choice != 0 for choice in table.column("choice").to_pylist()):
            raise BenchError(f"{part.name}: more than one choice per input")
        ids += [str(i) for i in table.column("id").to_pylist()]
        rows += [np.asarray(v, dtype=np.float32) for v in table.column(column).to_pylist()]
    return by_id(ids, np.array(rows))


# -- the arms ---------------------------------------------------------------------------------

#: One arm: sends the whole corpus, returns the vectors it got by id (none for unflagged arms).
Arm = Callable[[], Awaitable[dict[str, np.ndarray]]]


async def bounded(
    items: Sequence[Any], concurrency: int, send: Callable[[Any], Awaitable[None]]
) -> None:
    """``send`` each item once, at most ``concurrency`` at a time (one shared iterator)."""
    iterator = iter(items)

    async def worker() -> None:
        for item in iterator:
            await send(item)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items))))))


def _check(response: httpx.Response, what: str) -> dict[str, Any]:
    if response.status_code != 200:
        raise BenchError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    document: dict[str, Any] = response.json()
    return document


def completions_arm(
    client: httpx.AsyncClient,
    url: str,
    corpus: Sequence[Item],
    concurrency: int,
    fields: Mapping[str, Any] | None = None,
) -> Arm:
    """One-token completions of the corpus' token ids at ``url``; with ``fields`` (the flag)
    the vectors of the answers, read by the client module as ``extract`` reads them."""
    from vllm_hidden_state_proxy.client import read_hidden_states

    async def arm() -> dict[str, np.ndarray]:
        vectors: dict[str, np.ndarray] = {}

        async def send(item: Item) -> None:
            body = {"model": SERVED_MODEL_NAME, "prompt": item.tokens, "max_tokens": 1}
            response = await client.post(url + "/v1/completions", json={**body, **(fields or {})})
            document = _check(response, f"completions at {url}")
            if fields is not None:
                vectors[item.id] = np.asarray(read_hidden_states(document).entries[0].layer(-1))

        await bounded(corpus, concurrency, send)
        return vectors

    return arm


def embeddings_arm(
    client: httpx.AsyncClient, url: str, corpus: Sequence[Item], concurrency: int, batch: int
) -> Arm:
    """The corpus through ``/v1/embeddings``, ``batch`` inputs a request (token ids, base64
    float32, no normalisation), ``concurrency`` inputs in flight."""
    from vllm_hidden_state_proxy.client.answers import decode_values

    async def arm() -> dict[str, np.ndarray]:
        vectors: dict[str, np.ndarray] = {}
        chunks = [list(corpus[i : i + batch]) for i in range(0, len(corpus), batch)]

        async def send(chunk: list[Item]) -> None:
            body = {
                "model": SERVED_MODEL_NAME,
                "input": [item.tokens for item in chunk] if batch > 1 else chunk[0].tokens,
                "encoding_format": "base64",
                "use_activation": False,
            }
            document = _check(await client.post(url + "/v1/embeddings", json=body), "embeddings")
            data = sorted(document["data"], key=lambda d: int(d["index"]))
            if [int(d["index"]) for d in data] != list(range(len(chunk))):
                raise BenchError(f"embeddings: {len(data)} vectors for {len(chunk)} inputs")
            for item, answer in zip(chunk, data, strict=True):
                vectors[item.id] = decode_values(answer["embedding"], where="embedding")

        await bounded(chunks, max(1, concurrency // batch), send)
        return vectors

    return arm


def extract_arm(
    proxy_url: str, inputs: Path, work_dir: Path, pooling: str, concurrency: int | None
) -> Arm:
    """``extract`` itself (its runner in this process, as the command runs it), final layer,
    into a fresh dataset each time; the vectors read back from the dataset."""
    from vllm_hidden_state_proxy.extract.options import ExtractOptions
    from vllm_hidden_state_proxy.extract.runner import Extraction, ExtractSetupError

    runs = iter(range(1_000_000))

    async def arm() -> dict[str, np.ndarray]:
        output = work_dir / f"extract-{pooling}-{next(runs)}"
        options = ExtractOptions(
            urls=(proxy_url,), output=str(output), layers=(-1,), pooling=pooling,
            concurrency=concurrency,
        )  # fmt: skip
        messages = io.StringIO()
        extraction = Extraction(inputs, options, command_line=["bench"], stderr=messages)
        try:
            status = await extraction.run()
        except ExtractSetupError as problem:
            raise BenchError(f"extract: {problem}") from None
        if status != 0:
            raise BenchError(f"extract exited {status}: {messages.getvalue()[-500:]}")
        vectors = read_extract_dataset(output)
        shutil.rmtree(output, ignore_errors=True)
        return vectors

    return arm


@dataclass
class Tally:
    """One arm's whole-corpus runs: seconds each, and the vectors of the last."""

    seconds: list[float] = field(default_factory=list)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)

    def rate(self, inputs: int) -> float | None:
        return inputs / statistics.median(self.seconds) if self.seconds else None

    def spread(self, inputs: int) -> str:
        if not self.seconds:
            return ""
        return f"{inputs / max(self.seconds):.0f}-{inputs / min(self.seconds):.0f}"


async def take_turns(
    arms: Mapping[str, Arm], tallies: dict[str, Tally], rounds: int, progress: Progress
) -> None:
    """One warm-up run of each arm (not counted), then ``rounds`` rounds, the first arm
    rotating."""
    names = list(arms)
    for name in names:
        await arms[name]()
    for number, name in round_robin(names, rounds):
        started_at = time.perf_counter()
        vectors = await arms[name]()
        seconds = time.perf_counter() - started_at
        tally = tallies.setdefault(name, Tally())
        tally.seconds.append(seconds)
        tally.vectors = vectors
        progress.say(f"extract comparison, round {number + 1}: {name}: {seconds:.2f} s")


def _client(key: str | None) -> httpx.AsyncClient:
    """A client on the engine ``extract`` uses (aiohttp's, under httpx's API), so that every
    arm's client costs the same per request and the arms differ by their servers."""
    from vllm_hidden_state_proxy.extract.runner import client_transport

    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.AsyncClient(
        transport=client_transport(), headers=headers, timeout=600, trust_env=False
    )


def default_concurrency(stack: ChatStack) -> int:
    """What ``extract`` uses against this one proxy without ``--concurrency``."""
    from vllm_hidden_state_proxy.client import CAPTURE_PATH, read_capture
    from vllm_hidden_state_proxy.extract.proxies import proxy_limit

    response = httpx.get(stack.proxy_url + CAPTURE_PATH, timeout=30, trust_env=False)
    return proxy_limit(read_capture(response), matrix=False, n=1)


# -- the phase --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareOptions:
    inputs: int
    rounds: int
    #: ``extract``'s ``--concurrency`` (None: its default), and every other arm's in flight.
    concurrency: int | None
    transformers_batch_sizes: tuple[int, ...]
    startup_timeout: float


@dataclass
class Measured:
    """Everything the phase found, for its tables and figure."""

    inputs: int
    tokens: int
    concurrency: int
    tallies: dict[str, Tally] = field(default_factory=dict)
    #: Peak RSS (MiB) of each server's process tree while it was measured.
    memory: dict[str, float | None] = field(default_factory=dict)
    transformers: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


def generation_arms(
    stack: ChatStack,
    corpus: Sequence[Item],
    inputs: Path,
    work_dir: Path,
    concurrency: int,
    extract_concurrency: int | None,
    open_client: Callable[[str | None], httpx.AsyncClient],
) -> dict[str, Arm]:
    """``extract`` (both poolings), and the parts of its path at the same concurrency."""
    from vllm_hidden_state_proxy.client import hidden_state_fields

    direct = open_client(stack.vllm_api_key)
    via_proxy = open_client(stack.api_key)
    arms: dict[str, Arm] = {
        f"{EXTRACT}|{pooling}": extract_arm(
            stack.proxy_url, inputs, work_dir, pooling, extract_concurrency
        )
        for pooling in POOLINGS
    }
    arms["vLLM direct, unflagged|last"] = completions_arm(
        direct, stack.vllm_url, corpus, concurrency
    )
    arms["proxy, unflagged|last"] = completions_arm(via_proxy, stack.proxy_url, corpus, concurrency)
    for pooling in POOLINGS:
        fields = hidden_state_fields(layers=[-1], pooling=pooling)  # type: ignore[arg-type]
        arms[f"proxy, flagged (bare client)|{pooling}"] = completions_arm(
            via_proxy, stack.proxy_url, corpus, concurrency, fields
        )
    return arms


@contextlib.contextmanager
def pooling_server(
    model_dir: Path, pooling: str, log_dir: Path, timeout: float, progress: Progress
) -> Iterator[tuple[str, int]]:
    """Plain vLLM (the worker hook off) as an embedding server, ``pooling`` (LAST or MEAN)
    without normalisation; yields its URL and pid."""
    port = free_port()
    config = {"pooling_type": pooling.upper(), "use_activation": False}
    extra = [*VLLM_ARGS, "--runner", "pooling", "--convert", "embed"]
    command = vllm_command(str(model_dir), port, [*extra, "--pooler-config", json.dumps(config)])
    env = offline_environment()
    env[HOOK_ENABLED_ENV] = "0"
    url = f"http://127.0.0.1:{port}"
    with started(
        command,
        env,
        log_dir / f"pooling-server-{pooling}.log",
        url + "/health",
        timeout,
        f"the vLLM pooling server ({pooling.upper()} pooling)",
        progress,
    ) as process:
        yield url, process.pid


def run_transformers(
    model_dir: Path, inputs: Path, work_dir: Path, batch_sizes: Sequence[int], repeats: int
) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """The loop in its own process: its timings and its vectors by id (``reference_*``: batch
    size 1, unpadded; ``best_*``: the fastest batch size)."""
    output = work_dir / "transformers"
    command = [sys.executable, "-m", "vllm_hidden_state_proxy.bench.transformers_loop"]
    command += [str(model_dir), str(inputs), str(output)]
    command += ["--batch-sizes", ",".join(map(str, batch_sizes)), "--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, env=offline_environment())
    if done.returncode != 0:
        raise BenchError(f"the Transformers loop failed: {done.stderr[-1500:]}")
    timings = json.loads((output / "timings.json").read_text())
    with np.load(output / "vectors.npz") as stored:
        ids = [str(i) for i in stored["ids"]]
        vectors = {name: by_id(ids, stored[name]) for name in stored.files if name != "ids"}
    return timings, vectors


async def measure_server(
    arms_of: Callable[[Callable[[str | None], httpx.AsyncClient]], dict[str, Arm]],
    tallies: dict[str, Tally],
    rounds: int,
    progress: Progress,
) -> None:
    """The arms ``arms_of(new_client)`` builds, in turns; their clients closed at the end."""
    opened: list[httpx.AsyncClient] = []

    def new_client(key: str | None) -> httpx.AsyncClient:
        opened.append(_client(key))
        return opened[-1]

    try:
        await take_turns(arms_of(new_client), tallies, rounds, progress)
    finally:
        for client in opened:
            await client.aclose()


def pooling_arms(
    url: str,
    pooling: str,
    corpus: Sequence[Item],
    concurrency: int,
    new_client: Callable[[str | None], httpx.AsyncClient],
) -> dict[str, Arm]:
    """The pooling server's arms: one input a request, and ``POOLING_BATCH``."""
    client = new_client(None)
    return {
        f"{POOLING_ONE}|{pooling}": embeddings_arm(client, url, corpus, concurrency, 1),
        f"{POOLING_MANY}|{pooling}": embeddings_arm(
            client, url, corpus, concurrency, POOLING_BATCH
        ),
    }


def measure_extract_compare(
    model_dir: Path, log_dir: Path, options: CompareOptions, progress: Progress
) -> Measured:
    """The three methods, one server at a time (the caller holds the vLLM lock)."""
    from transformers import AutoTokenizer

    corpus = make_corpus(AutoTokenizer.from_pretrained(model_dir), options.inputs)
    work_dir = Path(tempfile.mkdtemp(prefix="hsp-bench-extract-"))
    try:
        inputs = work_dir / "corpus.jsonl"
        write_inputs(inputs, corpus)
        tokens = sum(len(item.tokens) for item in corpus)
        progress.say(
            f"extract comparison: {len(corpus)} inputs, {tokens} tokens, the Transformers loop"
        )
        timings, reference = run_transformers(
            model_dir, inputs, work_dir, options.transformers_batch_sizes, max(1, options.rounds)
        )
        measured = Measured(len(corpus), tokens, 0, transformers=timings, reference=reference)
        with chat_stack(
            model_dir, log_dir, options.startup_timeout, progress, name="extract-compare"
        ) as stack:
            concurrency = options.concurrency or default_concurrency(stack)
            measured.concurrency = concurrency
            with PeakRss(stack.pid, tree=True) as peak:
                asyncio.run(
                    measure_server(
                        lambda new: generation_arms(
                            stack, corpus, inputs, work_dir, concurrency, options.concurrency, new
                        ),
                        measured.tallies,
                        options.rounds,
                        progress,
                    )
                )
            measured.memory["generation"] = peak.peak_mib
        for pooling in POOLINGS:
            with pooling_server(model_dir, pooling, log_dir, options.startup_timeout, progress) as (
                url,
                pid,
            ):
                with PeakRss(pid, tree=True) as peak:
                    asyncio.run(
                        measure_server(
                            functools.partial(pooling_arms, url, pooling, corpus, concurrency),
                            measured.tallies,
                            options.rounds,
                            progress,
                        )
                    )
                measured.memory[f"pooling {pooling}"] = peak.peak_mib
        return measured
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
