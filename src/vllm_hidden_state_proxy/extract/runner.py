"""The run: inputs in, flagged batches out to the proxies with bounded concurrency (inputs in
flight counted, ``batches.py``, ``sender.py``), answers decoded by the client module and written
as they arrive (on a thread: ``write_behind.py``).

Each input is sent once (retried after 429, 503, 504, a connection error or a timeout, with
backoff; resent in a half of its batch when the batch failed) and ends in exactly one place:
the dataset (one row per choice), the errors file (with its reason), or, after Ctrl-C or an
error no input explains, nowhere yet: ``--resume`` sends it.
Whatever one input or its answer holds is at most that input's failure: its reading
(``inputs.py``), its request and answer (``exchange.py``: bounded in size and time), its rows
(``rows.py``). The manifest is written before the first request (the settings ``--resume``
checks, the run ``running``) and again at the end; Ctrl-C and SIGTERM are handled from the one
to the other (a second one while the run wraps up waits for the manifest).

Setup (``ExtractSetupError``, exit 2, nothing sent): INPUT (``inputs.check_corpus``), the
proxies' capture descriptions, ``--output`` (``output_dir.py``) and ``--resume``'s checks
(``resume.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from vllm_hidden_state_proxy.client import (
    CAPTURE_PATH,
    HiddenStateDecodeError,
    HiddenStateServerError,
    read_capture,
)
from vllm_hidden_state_proxy.extract.batches import Batcher, BodyMaker
from vllm_hidden_state_proxy.extract.dataset import (
    ERRORS,
    DatasetWriter,
    column_name,
    count_rows,
    dataset_schema,
    existing_ids,
    part_files,
    write_manifest,
)
from vllm_hidden_state_proxy.extract.exchange import Refused
from vllm_hidden_state_proxy.extract.inputs import (
    CorpusError,
    Input,
    InputProblem,
    check_corpus,
    input_format,
    read_inputs,
)
from vllm_hidden_state_proxy.extract.limits import answer_limit, body_limit
from vllm_hidden_state_proxy.extract.options import ExtractOptions
from vllm_hidden_state_proxy.extract.output_dir import (
    OutputRefused,
    check_output_path,
    open_errors,
    prepare_output,
    remove_unfinished,
)
from vllm_hidden_state_proxy.extract.progress import Counts, Progress, count_inputs
from vllm_hidden_state_proxy.extract.proxies import Proxy, most_in_flight, proxy_limits
from vllm_hidden_state_proxy.extract.resume import (
    ResumeRefused,
    check_manifest,
    check_parts,
    settings_of,
)
from vllm_hidden_state_proxy.extract.sender import Sender
from vllm_hidden_state_proxy.extract.storage import Location, StorageError, location
from vllm_hidden_state_proxy.extract.write_behind import WriteBehind
from vllm_hidden_state_proxy.protocol import MATRIX_POOLINGS

EXIT_FAILED = 1
EXIT_SETUP = 2
#: A worker failed in a way no input explains: the others stopped, the dataset is whole.
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130


class ExtractSetupError(Exception):
    """Nothing was sent: the options, INPUT, the servers or the output directory do not fit."""


@dataclass(frozen=True)
class Connected:
    """What :meth:`Extraction.connect` found and made."""

    proxies: list[Proxy]
    plan: dict[str, Any]
    sender: Sender
    #: Inputs in flight, within what every proxy allows.
    concurrency: int
    #: Inputs a request.
    batch_size: int


class Extraction:
    """One run of ``extract`` (see the module docstring)."""

    def __init__(
        self,
        input_path: Location,
        options: ExtractOptions,
        *,
        command_line: Sequence[str],
        transport: httpx.AsyncBaseTransport | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        self.input_path = input_path
        self.options = options
        self.command_line = list(command_line)
        self.transport = transport
        self.stderr = stderr or sys.stderr
        self.directory = location(options.output)  # a path, or an object store's URI
        self.counts = Counts()
        self.interrupted = False
        self._workers: list[asyncio.Future[None]] = []
        self._wrapping_up = False
        self._body_limit = 0

    # -- setup ---------------------------------------------------------------------------------

    async def connect(self, client: httpx.AsyncClient) -> Connected:
        """The proxies read, the plan made, and a sender bounded as a run's (its bodies, answers,
        inputs in flight and batch size): where a run and :class:`~.mapper.HiddenStateMapper`
        start."""
        proxies = await self._read_proxies(client)
        plan = self._plan(proxies)
        self._body_limit = body_limit([proxy.capture for proxy in proxies])
        most = most_in_flight(proxies)
        concurrency = self.options.concurrency or most_in_flight(proxies, default=True)
        if concurrency > most:
            self._say(f"--concurrency {concurrency} is more than the proxies allow: {most}")
            concurrency = most
        return Connected(
            proxies,
            plan,
            self._sender(client, proxies, plan),
            concurrency,
            self._batch_size(proxies, concurrency),
        )

    async def _read_proxies(self, client: httpx.AsyncClient) -> list[Proxy]:
        options = self.options
        matrix = options.pooling in MATRIX_POOLINGS or options.spans
        proxies = []
        for url in options.urls or ():
            try:
                response = await client.get(url.rstrip("/") + CAPTURE_PATH)
                capture = read_capture(response)
            except (httpx.HTTPError, HiddenStateServerError, HiddenStateDecodeError) as exc:
                raise ExtractSetupError(f"{url}: cannot read {CAPTURE_PATH}: {exc}") from None
            limit, default = proxy_limits(capture, matrix=matrix, n=options.n)
            proxies.append(Proxy(url.rstrip("/"), capture, response.json(), limit, default))
        first = proxies[0].capture
        for proxy in proxies[1:]:
            theirs = proxy.capture
            if (theirs.hidden_size, theirs.num_hidden_layers, theirs.model) != (
                first.hidden_size,
                first.num_hidden_layers,
                first.model,
            ):
                raise ExtractSetupError(
                    f"{proxy.url} serves {theirs.model} (hidden size {theirs.hidden_size}), "
                    f"{proxies[0].url} {first.model} ({first.hidden_size}): one model only"
                )
        return proxies

    def _plan(self, proxies: list[Proxy]) -> dict[str, Any]:
        options = self.options
        capture = proxies[0].capture
        top = capture.num_hidden_layers
        wanted = options.layers or capture.layers
        layers = list(dict.fromkeys(k + top + 1 if k < 0 else k for k in wanted))
        for proxy in proxies:
            missing = [k for k in layers if not proxy.capture.captures(k)]
            if missing:
                raise ExtractSetupError(
                    f"{proxy.url} does not capture layer(s) {missing} (it captures "
                    f"{list(proxy.capture.layers)}: serve --hidden-state-layers)"
                )
        pooling = options.pooling
        if options.spans:
            if pooling not in ("last", "mean"):
                raise ExtractSetupError("--spans are mean-pooled: leave --pooling out")
            pooling = "mean"
        if pooling not in capture.poolings:
            raise ExtractSetupError(
                f"the server does not offer pooling {pooling!r} (it offers {capture.poolings})"
            )
        return {
            "model": options.model or capture.model,
            "hidden_size": capture.hidden_size,
            "num_hidden_layers": top,
            "layers": layers,
            "columns": {column_name(k): k for k in layers},
            "pooling": pooling,
            "spans": options.spans,
            "matrix": options.pooling in MATRIX_POOLINGS or options.spans,
            "dtype": options.dtype,
            "max_tokens": options.max_tokens,
            "n": options.n,
            "extra_body": dict(options.extra_body) if options.extra_body else None,
        }

    def _prepare_directory(self, plan: dict[str, Any]) -> tuple[set[str], dict[str, Any] | None]:
        """The ids the dataset holds and its manifest (``None``: a new dataset), once
        ``--output`` and ``--resume``'s checks passed (``ExtractSetupError`` otherwise)."""
        directory = self.directory
        try:
            manifest = prepare_output(directory, resume=self.options.resume)
            if manifest is None:
                return set(), None
            check_manifest(directory, manifest, plan)
            schema = dataset_schema(
                plan["layers"],
                hidden_size=plan["hidden_size"],
                matrix=plan["matrix"],
                dtype=plan["dtype"],
            )
            check_parts(directory, schema, plan)
        except (OutputRefused, ResumeRefused) as refused:
            raise ExtractSetupError(str(refused)) from None
        if (manifest.get("runs") or [{}])[-1].get("state") == "running":
            # Nothing locks the directory: two runs at once would each write the same ids.
            self._say(
                f"the last run on {directory} never ended (killed?); its whole parts are kept. "
                "Make sure it is not still running."
            )
        try:
            done = existing_ids(directory)
        except (OSError, ValueError) as exc:  # a part whose footer reads but whose data not
            raise ExtractSetupError(
                f"--resume: {directory}'s parts cannot be read: {exc}"
            ) from None
        for left in remove_unfinished(directory):
            self._say(f"removed {left.name}, a file an earlier run did not finish")
        return done, manifest

    # -- the run -------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self.stderr.write(f"extract: {message}\n")
        self.stderr.flush()

    def _fail(
        self, errors: IO[str], line: int, id_: str | None, reason: str, status: int | None
    ) -> None:
        self.counts.failed += 1
        errors.write(
            json.dumps({"line": line, "id": id_, "status": status, "reason": reason}) + "\n"
        )
        errors.flush()

    async def run(self) -> int:
        options = self.options
        fmt = input_format(self.input_path, options.input_format)
        try:
            check_corpus(self.input_path, fmt)
            check_output_path(self.directory)
        except (CorpusError, OutputRefused) as problem:
            raise ExtractSetupError(str(problem)) from None
        headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        async with httpx.AsyncClient(
            transport=self.transport or client_transport(),
            timeout=options.timeout,
            headers=headers,
            trust_env=False,
        ) as client:
            connected = await self.connect(client)
            proxies, plan, concurrency = connected.proxies, connected.plan, connected.concurrency
            done, manifest = self._prepare_directory(plan)
            try:
                errors = open_errors(self.directory, replace=manifest is not None)
            except OutputRefused as refused:
                raise ExtractSetupError(str(refused)) from None
            writer = self._writer(plan)
            behind = WriteBehind(writer)
            show = options.progress or self.stderr.isatty()
            progress = Progress(
                self.stderr, count_inputs(self.input_path, fmt) if show else None, show
            )
            inputs = read_inputs(
                self.input_path, fmt, spans=options.spans, max_line_bytes=self._body_limit
            )
            runs = [*(manifest or {}).get("runs", []), self._run_record(proxies, concurrency)]
            started = time.monotonic()
            stopped_by: Exception | None = None
            with errors, self._signals():
                # Written before anything is sent: a run killed hard (SIGKILL, out of memory)
                # leaves a manifest whose settings --resume checks, its run still "running".
                self._write_manifest(plan, proxies, runs, ids=len(done))
                try:
                    sender = connected.sender
                    stopped_by = await self._drive(
                        sender, inputs, done, behind, errors, progress, concurrency
                    )
                finally:
                    self._wrapping_up = True  # a signal now: the manifest is written first
                    try:
                        behind.close()
                    except Exception as error:  # a full disk: the part stays .tmp (not data)
                        stopped_by = stopped_by or error
                    progress.update(self.counts, force=True)
                    progress.end()
                seconds = time.monotonic() - started
                state = (
                    "stopped" if stopped_by else "interrupted" if self.interrupted else "finished"
                )
                runs[-1] = self._run_record(
                    proxies, concurrency, writer, seconds, state, stopped_by
                )
                ids = len(existing_ids(self.directory))
                self._write_manifest(plan, proxies, runs, ids=ids)
        self._summary(writer, seconds, stopped_by, ids)
        if stopped_by is not None:
            return EXIT_STOPPED
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if self.counts.failed else 0

    def _sender(
        self, client: httpx.AsyncClient, proxies: list[Proxy], plan: dict[str, Any]
    ) -> Sender:
        options = self.options
        records = max(proxy.capture.limits.get("max_record_bytes", 0) for proxy in proxies)
        most = options.max_answer_size
        one = most or answer_limit(plan, max_record_bytes=records)

        def limit(inputs: int) -> int:
            if most is not None or inputs == 1:
                return one * inputs
            return answer_limit(plan, max_record_bytes=records, inputs=inputs)

        return Sender(
            client,
            proxies,
            plan,
            BodyMaker(plan, options.extra_body),
            self.counts,
            body_limit=self._body_limit,
            answer_limit=limit,
            retries=options.retries,
            timeout=options.timeout,
            sleep=_sleep,
        )

    def _batch_size(self, proxies: list[Proxy], concurrency: int) -> int:
        """``--batch-size``, at most the inputs in flight and what every proxy takes in one
        request (its ``--max-prompts``, its ring slots)."""
        takes = min(
            min(proxy.limit, proxy.capture.limits.get("max_prompts", proxy.limit))
            for proxy in proxies
        )
        return max(1, min(self.options.batch_size, concurrency, takes))

    def _writer(self, plan: dict[str, Any]) -> DatasetWriter:
        options = self.options
        return DatasetWriter(
            self.directory,
            layers=plan["layers"],
            hidden_size=plan["hidden_size"],
            matrix=plan["matrix"],
            dtype=plan["dtype"],
            rows_per_file=options.rows_per_file,
            row_group_rows=options.row_group_rows,
            settings=settings_of(plan),
        )

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM stop the workers (:meth:`_interrupt`) from before the first
        manifest to after the last: never a ``KeyboardInterrupt`` between them."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, self._interrupt)
            loop.add_signal_handler(signal.SIGTERM, self._interrupt)
        try:
            yield
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
                loop.remove_signal_handler(signal.SIGTERM)

    def _interrupt(self) -> None:
        if self._wrapping_up:  # the parts are closed and the manifest written: it is quick
            return
        self.interrupted = True
        for worker in self._workers:  # in-flight inputs are not written: --resume sends them
            worker.cancel()

    async def _drive(
        self,
        sender: Sender,
        inputs: Iterator[Input | InputProblem],
        done: set[str],
        behind: WriteBehind,
        errors: IO[str],
        progress: Progress,
        concurrency: int,
    ) -> Exception | None:
        """Every input, in batches, ``concurrency`` inputs in flight (each batch's inputs
        counted); the error that stopped them, if one failed in a way no input explains (a bug,
        a full disk, an unreadable corpus): the others are cancelled then, as on Ctrl-C, so the
        dataset is closed and resumable."""
        counts = self.counts
        size = self._batch_size(sender.proxies, concurrency)

        def skip(item: Input | InputProblem) -> bool:
            counts.seen += 1
            if isinstance(item, InputProblem):
                self._fail(errors, item.line, item.id, item.reason, None)
                return True
            if item.id in done:
                counts.skipped += 1
                return True
            return False

        batcher = Batcher(inputs, size, self.options.n, skip)

        async def work() -> None:
            # Each input once; none after an interrupt (its cancellation is the way out, this
            # the net under it should a cancellation ever be lost).
            while not self.interrupted and (batch := await batcher.next()) is not None:
                for item, result in await sender.send(batch):
                    if isinstance(result, Refused):
                        line, id_ = item.input.line, item.input.id
                        self._fail(errors, line, id_, result.reason, result.status)
                        continue
                    await behind.add(result)
                    counts.written += 1
                    counts.rows += len(result)
                progress.update(counts)

        if self.interrupted:  # a signal before the first input
            return None
        workers = self._workers = [
            asyncio.ensure_future(work()) for _ in range(max(1, concurrency // size))
        ]
        try:
            await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for worker in workers:  # all ended, or one failed: stop the others
                worker.cancel()
        ends = await asyncio.gather(*workers, return_exceptions=True)
        for end in ends:
            if isinstance(end, Exception):
                return end
            if isinstance(end, BaseException) and not isinstance(end, asyncio.CancelledError):
                raise end  # KeyboardInterrupt, SystemExit: not ours to turn into a status
        return None

    def _run_record(
        self,
        proxies: list[Proxy],
        concurrency: int,
        writer: DatasetWriter | None = None,
        seconds: float = 0.0,
        state: str = "running",
        stopped_by: Exception | None = None,
    ) -> dict[str, Any]:
        """This run's entry of the manifest's ``runs``: ``state`` is ``running`` until it ends
        (``finished``, ``interrupted``, or ``stopped`` by ``error``)."""
        counts = self.counts
        record: dict[str, Any] = {
            "command_line": self.command_line,
            "input": str(self.input_path),
            "urls": [proxy.url for proxy in proxies],
            "concurrency": concurrency,
            "batch_size": self._batch_size(proxies, concurrency),
            "state": state,
        }
        if writer is None:
            return record
        record.update(
            seconds=round(seconds, 3),
            inputs_written=counts.written,
            rows_written=writer.rows_written,
            skipped_already_written=counts.skipped,
            failed=counts.failed,
            retries=counts.retries,
            retries_by_cause=dict(sorted(counts.retries_by_cause.items())),
            inputs_per_second=round(counts.written / seconds if seconds > 0 else 0.0, 3),
            parts=writer.parts_written,
        )
        if stopped_by is not None:
            record["error"] = f"{type(stopped_by).__name__}: {stopped_by}"
        return record

    def _write_manifest(
        self, plan: dict[str, Any], proxies: list[Proxy], runs: list[dict[str, Any]], ids: int
    ) -> None:
        document = {
            **plan,
            "capture": proxies[0].document,
            "counts": {"rows": count_rows(self.directory), "ids": ids},
            "parts": [p.name for p in part_files(self.directory)],
            "errors": ERRORS,
            "runs": runs,
        }
        write_manifest(self.directory, document)

    def _summary(
        self, writer: DatasetWriter, seconds: float, stopped_by: Exception | None, ids: int
    ) -> None:
        counts = self.counts
        rate = counts.written / seconds if seconds > 0 else 0.0
        if stopped_by is not None:
            self.stderr.write("".join(traceback.format_exception(stopped_by)))
        summary = (
            f"{counts.written} inputs written ({writer.rows_written} rows) in {seconds:.1f} s "
            f"({rate:.1f} inputs/s); {counts.skipped} skipped (already in the dataset); "
            f"{counts.failed} failed"
            + (f" (see {self.directory / ERRORS})" if counts.failed else "")
            + f"; {counts.retries_said()}; the dataset holds {ids} ids"
        )
        if stopped_by is not None:
            summary += (
                f"; stopped by {type(stopped_by).__name__}: {stopped_by}: run again with "
                "--resume to finish"
            )
        elif self.interrupted:
            summary += "; interrupted: run again with --resume to finish"
        self._say(summary)


def client_transport() -> httpx.AsyncBaseTransport:
    """httpx's API on the proxy's own HTTP/1.1 engine, as the proxy sends to vLLM (the default
    of :func:`~vllm_hidden_state_proxy.transport.create_pool`): httpx's own pool costs CPU
    per request that grows with the connections open (measured with 16 to 256 in flight:
    ~2 to ~9 ms per request, docs/benchmark.md), where a CPU host has none to spare. Idle
    connections are retired before the proxy (uvicorn) closes them."""
    from vllm_hidden_state_proxy.transport import create_pool

    return create_pool(max_connections=None)


async def _sleep(seconds: float) -> None:
    """The wait before a retry (the tests' seam: they record it instead)."""
    await asyncio.sleep(seconds)


def run_extract(
    input_path: str | Path,
    options: ExtractOptions,
    *,
    command_line: Sequence[str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``extract`` (the exit status: 0 when every input was written, 1 when some failed,
    2 when nothing could start, 3 when an error no input explains stopped it, 130 when
    interrupted)."""
    try:
        extraction = Extraction(
            location(input_path),
            options,
            command_line=sys.argv if command_line is None else command_line,
            transport=transport,
            stderr=stderr,
        )
    except StorageError as problem:
        (stderr or sys.stderr).write(f"extract: {problem}\n")
        return EXIT_SETUP
    try:
        return asyncio.run(extraction.run())
    except ExtractSetupError as problem:
        extraction._say(str(problem))
        return EXIT_SETUP
