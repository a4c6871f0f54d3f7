"""The extract comparison (issues #38, #46; the phase ``extract``): vectors per second of
``extract`` (its runner as a library, at its defaults) through ``serve``'s proxy against vLLM's
pooling server (one per pooling, LAST or MEAN, unnormalised) sent the same inputs through
``/v1/embeddings``, one and 32 a request; one corpus as texts, token ids and chats. One vLLM at
a time (the caller holds the lock); the arms of one server take turns in rounds, a turn one
whole corpus. Every arm's vectors are compared by id with the pooling server's, one input a
request."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vllm_hidden_state_proxy.bench.client import BenchError, ChatStack
from vllm_hidden_state_proxy.bench.options import EXTRACT_ROUNDS, BenchOptions
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.report import Row, Table
from vllm_hidden_state_proxy.bench.servers import SERVED_MODEL_NAME, VLLM_ARGS, chat_stack, started
from vllm_hidden_state_proxy.bench.stats import ratio
from vllm_hidden_state_proxy.bench.turns import Tally, burst, run_async, take_turns
from vllm_hidden_state_proxy.processes import free_port, offline_environment, vllm_command
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV

POOLINGS = ("last", "mean")
#: Acceptance thresholds in float32, as the e2e tests' (tests/e2e/reference.py, issue #2).
MIN_COSINE, MAX_RELATIVE_L2 = 0.99999, 1e-3
#: The pooling server's inputs per request in its batched arm (in flight: the concurrency over
#: this, so that as many inputs are in flight as in every other arm).
POOLING_BATCH = 32
KINDS = ("text", "ids", "chat")
TITLE = "Extract: a corpus to vectors, extract against vLLM's pooling server"
EXTRACT = "extract -> proxy -> generation vLLM"
POOLING_ONE = "pooling server, 1 input a request"
POOLING_MANY = f"pooling server, {POOLING_BATCH} inputs a request"
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
    text: str = ""
    chat_tokens: tuple[int, ...] = ()

    def record(self, kind: str) -> dict[str, Any]:  # its line of extract's JSONL
        if kind == "chat":
            return {"id": self.id, "messages": [{"role": "user", "content": self.text}]}
        return {"id": self.id, "prompt": self.text if kind == "text" else self.tokens}

    def pooling_input(self, kind: str) -> str | list[int]:  # a chat: its template's tokens
        return (
            self.text if kind == "text" else self.tokens if kind == "ids" else [*self.chat_tokens]
        )


def make_corpus(tokenizer: Any, count: int) -> list[Item]:
    """``count`` distinct texts of 4 to 80 words (so 5 to ~100 tokens), their token ids (no
    special tokens) and a chat of each as its template renders it (when the tokenizer has one)."""
    items = []
    for number in range(count):
        length = 4 + (number * 37) % 77
        words = [_WORDS[(number * 7 + k * 13 + k * k) % len(_WORDS)] for k in range(length)]
        text = f"Input {number}: " + " ".join(words) + "."
        chat: tuple[int, ...] = ()
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            chat = tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        items.append(Item(f"in-{number}", tokens, text, chat))
    return items


def agreement(
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    min_cosine: float = MIN_COSINE,
) -> str:
    """``yes`` or ``**NO**``, and the worst cosine and relative L2 error (in float64) of
    ``actual``'s vectors against ``expected``'s of the same ids, or the ids either side lacks."""
    missing, unexpected = len(set(expected) - set(actual)), len(set(actual) - set(expected))
    if missing or unexpected or not expected:
        return f"**NO**: {missing} missing, {unexpected} unexpected of {len(expected)}"
    ids = sorted(expected)
    try:
        a, e = (
            np.stack([np.ravel(vectors[i]) for i in ids]).astype(np.float64)
            for vectors in (actual, expected)
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            norm_a, norm_e = np.linalg.norm(a, axis=1), np.linalg.norm(e, axis=1)
            cosine = float(np.min(np.sum(a * e, axis=1) / (norm_a * norm_e)))
            error = float(np.max(np.linalg.norm(a - e, axis=1) / norm_e))
    except ValueError:  # vectors of other lengths
        return "**NO**: vectors of another length"
    ok = cosine >= min_cosine and error <= MAX_RELATIVE_L2  # False for NaN (a zero vector)
    return ("yes" if ok else "**NO**") + f": cos >= {cosine:.7f}, rel L2 <= {error:.1e}"


def read_extract_dataset(directory: Path) -> dict[str, np.ndarray]:
    """The final-layer vectors of an ``extract`` dataset by id (one row, choice 0, an input)."""
    import pyarrow.parquet as pq

    from vllm_hidden_state_proxy.extract.dataset import column_name, read_manifest

    manifest = read_manifest(directory)
    if manifest is None:
        raise BenchError(f"{directory}: no manifest: extract did not finish")
    column = column_name(int(manifest["layers"][0]))
    table = pq.read_table(directory, columns=["id", "choice", column]).to_pydict()
    ids = [str(i) for i in table["id"]]
    if any(table["choice"]):
        raise BenchError(f"{directory}: more than one choice per input")
    if len(set(ids)) != len(ids):
        raise BenchError(f"{directory}: {len(ids) - len(set(ids))} ids repeated")
    return {i: np.asarray(v, dtype=np.float32) for i, v in zip(ids, table[column], strict=True)}


#: One arm: sends the whole corpus on a client, returns the vectors it got by id.
Arm = Callable[[httpx.AsyncClient], Awaitable[dict[str, np.ndarray]]]


def embeddings_arm(
    url: str, corpus: Sequence[Item], concurrency: int, batch: int, kind: str = "ids"
) -> Arm:
    """The corpus through ``/v1/embeddings``, ``batch`` inputs a request (as ``kind``, base64
    float32, no normalisation), ``concurrency`` inputs in flight."""
    from vllm_hidden_state_proxy.client.answers import decode_values

    async def arm(client: httpx.AsyncClient) -> dict[str, np.ndarray]:
        vectors: dict[str, np.ndarray] = {}
        chunks = iter([list(corpus[i : i + batch]) for i in range(0, len(corpus), batch)])

        async def request() -> float:  # the next chunk: each sent once
            chunk = next(chunks)
            inputs = [item.pooling_input(kind) for item in chunk]
            body = {
                "model": SERVED_MODEL_NAME,
                "input": inputs if batch > 1 else inputs[0],
                "encoding_format": "base64",
                "use_activation": False,
            }
            response = await client.post(url + "/v1/embeddings", json=body)
            if response.status_code != 200:
                raise BenchError(f"embeddings: HTTP {response.status_code}: {response.text[:300]}")
            data = sorted(response.json()["data"], key=lambda d: int(d["index"]))
            if [int(d["index"]) for d in data] != list(range(len(chunk))):
                raise BenchError(f"embeddings: {len(data)} vectors for {len(chunk)} inputs")
            for item, answer in zip(chunk, data, strict=True):
                vectors[item.id] = decode_values(answer["embedding"], where="embedding")
            return 0.0

        requests = -(-len(corpus) // batch)
        await burst(request, "the pooling server", requests, max(1, concurrency // batch))
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

    async def arm(_: httpx.AsyncClient) -> dict[str, np.ndarray]:
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


def default_concurrency(stack: ChatStack) -> int:
    """What ``extract`` uses against this one proxy without ``--concurrency``."""
    from vllm_hidden_state_proxy.client import CAPTURE_PATH, read_capture
    from vllm_hidden_state_proxy.extract.proxies import proxy_limit

    response = httpx.get(stack.proxy_url + CAPTURE_PATH, timeout=30, trust_env=False)
    return proxy_limit(read_capture(response), matrix=False, n=1)


@contextlib.contextmanager
def pooling_server(
    model_dir: Path, pooling: str, log_dir: Path, timeout: float, progress: Progress
) -> Iterator[str]:
    """Plain vLLM (no hook) as an embedding server, ``pooling`` unnormalised; yields its URL."""
    port = free_port()
    config = json.dumps({"pooling_type": pooling.upper(), "use_activation": False})
    extra = [*VLLM_ARGS, "--runner", "pooling", "--convert", "embed", "--pooler-config", config]
    env = {**offline_environment(), HOOK_ENABLED_ENV: "0"}
    url = f"http://127.0.0.1:{port}"
    log, name = log_dir / f"pooling-server-{pooling}.log", f"the vLLM pooling server ({pooling})"
    command = vllm_command(str(model_dir), port, extra)
    with started(command, env, log, url + "/health", timeout, name, progress):
        yield url


def _client(_: str) -> httpx.AsyncClient:
    """A client on the engine ``extract`` uses (the default of ``create_pool``, under httpx's
    API), so that every arm's client costs the same per request and the arms differ by their
    servers."""
    from vllm_hidden_state_proxy.extract.runner import client_transport

    return httpx.AsyncClient(transport=client_transport(), timeout=600, trust_env=False)


@dataclass
class Measured:
    """Everything the phase found, for its tables; arms are named ``method|input|pooling``."""

    inputs: int
    tokens: int
    concurrency: int = 0
    #: Each arm's turns, one whole corpus each (one "request" an input).
    tallies: dict[str, Tally] = field(default_factory=dict)
    #: Each arm's vectors of its last turn, by id.
    vectors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    async def take_turns(self, arms: Mapping[str, Arm], rounds: int, progress: Progress) -> None:
        """One warm-up turn of each arm (not counted), then ``rounds`` rounds of turns."""

        async def turn(client: httpx.AsyncClient, name: str, _: int) -> int:
            started_at = time.perf_counter()
            self.vectors[name] = await arms[name](client)
            seconds = time.perf_counter() - started_at
            self.tallies.setdefault(name, Tally()).add(self.inputs, seconds, ())
            return self.inputs

        async def warm_up(client: httpx.AsyncClient, name: str) -> None:
            await arms[name](client)

        task = progress.task(
            f"extract comparison: {len(arms)} arms", len(arms) * rounds * self.inputs
        )
        await take_turns(list(arms), _client, turn, rounds, task, warm_up=warm_up)
        task.done()


def run(model_dir: Path, options: BenchOptions, progress: Progress) -> Table:
    """The phase: its servers one at a time (the caller holds the vLLM lock), its table."""
    from transformers import AutoTokenizer

    rounds = 1 if options.smoke else EXTRACT_ROUNDS
    corpus = make_corpus(AutoTokenizer.from_pretrained(model_dir), options.extract_inputs)
    measured = Measured(len(corpus), sum(len(item.tokens) for item in corpus))
    progress.say(f"extract comparison: {measured.inputs} inputs, {measured.tokens} tokens")
    log_dir, timeout = options.output_dir, options.startup_timeout
    work_dir = Path(tempfile.mkdtemp(prefix="hsp-bench-extract-"))
    try:
        kinds = [k for k in KINDS if k != "chat" or corpus[0].chat_tokens]
        inputs = {kind: work_dir / f"{kind}.jsonl" for kind in kinds}  # extract's JSONL
        for kind, path in inputs.items():
            path.write_text("".join(json.dumps(i.record(kind)) + "\n" for i in corpus))
        with chat_stack(model_dir, log_dir, timeout, progress, name="extract-compare") as stack:
            measured.concurrency = options.extract_concurrency or default_concurrency(stack)
            arms = {
                f"{EXTRACT}|{k}|{p}": extract_arm(
                    stack.proxy_url, inputs[k], work_dir, p, options.extract_concurrency
                )
                for k in kinds
                for p in POOLINGS
            }
            run_async(measured.take_turns(arms, rounds, progress))
        for pooling in POOLINGS:
            with pooling_server(model_dir, pooling, log_dir, timeout, progress) as url:
                arms = {
                    f"{name}|{k}|{pooling}": embeddings_arm(
                        url, corpus, measured.concurrency, batch, k
                    )
                    for k in kinds
                    for name, batch in ((POOLING_ONE, 1), (POOLING_MANY, POOLING_BATCH))
                }
                run_async(measured.take_turns(arms, rounds, progress))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return compare_table(measured)


def compare_table(measured: Measured) -> Table:
    """The comparison's table: each method's rate and its vectors against the reference's."""
    rows: list[Row] = []
    rates = {name: statistics.median(tally.rates) for name, tally in measured.tallies.items()}
    for group in dict.fromkeys(name.split("|", 1)[1] for name in measured.tallies):
        reference = measured.vectors.get(f"{POOLING_ONE}|{group}", {})
        for method in (EXTRACT, POOLING_ONE, POOLING_MANY):
            if (name := f"{method}|{group}") not in rates:
                continue
            tally = measured.tallies[name]
            *kind, pooling = group.split("|")
            rows.append(
                {
                    "method": method,
                    "input": kind[0] if kind else "ids",
                    "pooling": pooling,
                    "vectors/s": rates[name],
                    "range over rounds": f"{min(tally.rates):.0f}-{max(tally.rates):.0f}",
                    f"/ pooling server ({POOLING_BATCH} a request)": ratio(
                        rates[name], rates.get(f"{POOLING_MANY}|{group}")
                    ),
                    "equals the pooling server": "(the reference)"
                    if method == POOLING_ONE
                    else agreement(measured.vectors[name], reference),
                }
            )
    note = (
        f"{measured.inputs} prompts ({measured.tokens} tokens as ids; as texts, and as chats "
        f"in the chat template), final layer, {measured.concurrency} inputs in flight in every "
        "arm (extract's default here, in batches of 32; the pooling server's batched arm as "
        "many inputs in flight). vectors/s: the median over rounds of one whole corpus' rate "
        "(extract: the whole library call, dataset written). Vectors compared by id with the "
        f"pooling server's, one input a request (cosine >= {MIN_COSINE}, relative L2 <= "
        f"{MAX_RELATIVE_L2:g})."
    )
    return Table(TITLE, rows, note)
