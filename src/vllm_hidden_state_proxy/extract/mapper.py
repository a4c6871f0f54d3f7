"""``extract`` as a mapper, for the engines users already have: Ray Data's ``map_batches`` and
Hugging Face ``datasets.Dataset.map(batched=True)`` (docs/extract.md, "Beyond one machine").

:class:`HiddenStateMapper` takes a batch of inputs as columns, extract's (``id``, and
``messages`` or ``prompt``; ``spans`` with ``spans=True``), given as a dict of lists or arrays
(Ray's ``numpy`` batches, ``datasets``' batches), a pyarrow Table or a pandas DataFrame, and
returns a pyarrow Table of the columns extract writes (``id``, ``choice``, ``position``,
``num_prompt_tokens``, ``num_output_tokens``, ``layer_K``) and ``error``: null for an input's
rows, the reason for an input that failed (its other columns null then, but ``id``). One row
per input, or per input and choice with an answer pooling and ``n`` above 1: in the batch's
order. A bad input, or one whose answer cannot make rows, is its row's ``error``, never its
batch's failure; proxies that cannot be reached when the instance starts
(:class:`~vllm_hidden_state_proxy.extract.runner.ExtractSetupError`), or that stay busy or
unreachable past the retries (:class:`ProxiesUnavailable`), fail it, as a bug does.

Everything between is extract's, not another copy: the options (:class:`ExtractOptions`' names
and defaults), each input's checks (``inputs.py``), the proxies' capture descriptions, the plan,
the batches (``batches.py``: ``batch_size`` inputs of one kind a request), their retries,
halving and bounds (``sender.py``, ``exchange.py``), the rows (``rows.py``) and the table
(``dataset.rows_table``).

An instance holds one HTTP client to its proxies, made at its first batch, on an event loop in
a thread of its own (the caller may run a loop of its own: a notebook's), with up to
``concurrency`` requests in flight (by default what the proxies allow, as extract's); so a Ray
actor pool of ``concurrency=N`` has N clients. It pickles without them (``datasets`` hashes it,
Ray and ``num_proc`` ship it) and makes them again where it is used. It imports neither Ray nor
``datasets``: it is called by them.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from vllm_hidden_state_proxy.extract.batches import Batcher
from vllm_hidden_state_proxy.extract.dataset import dataset_schema, rows_table
from vllm_hidden_state_proxy.extract.exchange import Refused
from vllm_hidden_state_proxy.extract.inputs import Input, InputProblem, check_record
from vllm_hidden_state_proxy.extract.options import ExtractOptions
from vllm_hidden_state_proxy.extract.runner import Extraction, client_transport
from vllm_hidden_state_proxy.extract.sender import GaveUp, Sender
from vllm_hidden_state_proxy.protocol import API_KEY_ENV

#: The input columns read from a batch (any other is left alone).
INPUT_COLUMNS = ("id", "messages", "prompt", "spans")
#: The column that says why an input failed (null for its rows otherwise).
ERROR_COLUMN = "error"
#: extract's options a mapper takes: what decides the requests and their answers' reading.
MAPPER_OPTIONS = (
    "layers", "pooling", "spans", "dtype", "concurrency", "batch_size", "max_tokens", "n",
    "extra_body", "model", "api_key", "retries", "timeout", "max_answer_size",
)  # fmt: skip

T = TypeVar("T")


class ProxiesUnavailable(Exception):
    """The proxies stayed busy or unreachable past ``retries``: no input's fault, so the batch
    fails (Ray, or whoever runs it, may run it again) rather than give every row an error."""


@dataclass
class _Session:
    """What an instance made at its first batch: its client, and extract's sender to its
    proxies with the run's plan, the inputs in flight and in a request."""

    client: httpx.AsyncClient
    sender: Sender
    plan: dict[str, Any]
    schema: Any
    concurrency: int
    batch_size: int


class HiddenStateMapper:
    """A batch of inputs in, a pyarrow Table of their hidden states out (see the module
    docstring). ``urls``: one proxy's URL or several (each request goes to the one with the
    fewest in flight); ``options``: extract's, by their field names (``layers=(0, -1)``,
    ``pooling="mean"``, ``extra_body={...}``: :data:`MAPPER_OPTIONS`). The API key, if the
    proxies have one, is ``api_key`` or the ``HIDDEN_STATE_PROXY_API_KEY`` variable."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(MAPPER_OPTIONS))
        if unknown:
            raise TypeError(
                f"HiddenStateMapper takes no {', '.join(unknown)} (it takes {MAPPER_OPTIONS})"
            )
        if isinstance(urls, str):
            urls = (urls,)
        if not urls:
            raise ValueError("HiddenStateMapper needs a proxy's URL")
        if options.get("layers") is not None:
            options["layers"] = tuple(options["layers"])
        options.setdefault("api_key", os.environ.get(API_KEY_ENV))
        self.options = replace(ExtractOptions(), urls=tuple(urls), output="", **options)
        #: A test's seam (an in-process fake proxy); ``None``: extract's own client transport.
        self.transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: _Session | None = None
        self._lock = threading.Lock()

    # -- pickling: the options only --------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "transport": self.transport}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self.transport = state["transport"]
        self._loop = self._thread = self._session = None
        self._lock = threading.Lock()

    # -- the loop and the client -------------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this instance's loop (started the first time) and wait."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="hidden-state-mapper", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open(self) -> _Session:
        options = self.options
        headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        client = httpx.AsyncClient(
            transport=self.transport or client_transport(),
            timeout=options.timeout,
            headers=headers,
            trust_env=False,
        )
        try:
            extraction = Extraction(
                Path(), options, command_line=[], transport=self.transport, stderr=io.StringIO()
            )
            connected = await extraction.connect(client)
        except BaseException:
            await client.aclose()
            raise
        # The bounds of a request and its answer, in flight and a batch, as extract's run's.
        return _Session(
            client,
            connected.sender,
            connected.plan,
            output_schema(connected.plan),
            connected.concurrency,
            connected.batch_size,
        )

    def close(self) -> None:
        """Close the client and stop the loop (a Ray actor's or the process's end does too)."""
        loop, session = self._loop, self._session
        if loop is None:
            return
        if session is not None:
            asyncio.run_coroutine_threadsafe(session.client.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join()
        loop.close()
        self._loop = self._thread = self._session = None

    def __enter__(self) -> HiddenStateMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- a batch ---------------------------------------------------------------------------------

    def __call__(self, batch: Any) -> Any:
        """``batch``'s hidden states: a pyarrow Table (see the module docstring)."""
        records = input_records(batch)
        return self._run(self._map(records))

    async def _map(self, records: list[dict[str, Any]]) -> Any:
        if self._session is None:
            self._session = await self._open()
        session = self._session
        plan = session.plan
        checked = [
            check_record(line, record, spans=self.options.spans)
            for line, record in enumerate(records, start=1)
        ]
        # Each input's rows, or its failure, by its place in the batch (its line).
        results: dict[int, list[dict[str, Any]]] = {
            item.line: [_failed(item.id, item.reason)]
            for item in checked
            if isinstance(item, InputProblem)
        }
        inputs = [item for item in checked if isinstance(item, Input)]
        batcher = Batcher(iter(inputs), session.batch_size, plan["n"], lambda item: False)

        async def work() -> None:
            while (batch := await batcher.next()) is not None:
                for item, result in await session.sender.send(batch):
                    if isinstance(result, GaveUp):
                        raise ProxiesUnavailable(result.reason)
                    line = item.input.line
                    if isinstance(result, Refused):
                        results[line] = [_failed(item.input.id, result.reason)]
                    else:
                        results[line] = result

        workers = max(1, session.concurrency // session.batch_size)
        await asyncio.gather(*(work() for _ in range(workers)))
        rows = [row for line in range(1, len(records) + 1) for row in results[line]]
        return rows_table(
            rows,
            session.schema,
            layers=plan["layers"],
            hidden_size=plan["hidden_size"],
            matrix=plan["matrix"],
            dtype=np.dtype(np.float16 if plan["dtype"] == "float16" else np.float32),
        )


def output_schema(plan: Mapping[str, Any]) -> Any:
    """extract's columns for ``plan``, every one nullable (a failed input has only its id, if
    it had one), and :data:`ERROR_COLUMN`."""
    import pyarrow as pa

    schema = dataset_schema(
        plan["layers"], hidden_size=plan["hidden_size"], matrix=plan["matrix"], dtype=plan["dtype"]
    )
    columns = [field.with_nullable(True) for field in schema]
    return pa.schema([*columns, pa.field(ERROR_COLUMN, pa.string())])


def _failed(id_: str | None, reason: str) -> dict[str, Any]:
    return {"id": id_, ERROR_COLUMN: reason}


def input_records(batch: Any) -> list[dict[str, Any]]:
    """The inputs of a batch of columns (a dict of lists or arrays, a pyarrow Table or
    RecordBatch, a pandas DataFrame) as extract reads a Parquet row: plain Python values, a
    missing value (``None``, NaN, pandas' NA) left out."""
    if hasattr(batch, "to_pylist"):  # pyarrow
        rows = batch.select([c for c in INPUT_COLUMNS if c in batch.column_names]).to_pylist()
    elif hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        rows = batch[[c for c in INPUT_COLUMNS if c in batch.columns]].to_dict("records")
    elif isinstance(batch, Mapping):  # Ray's numpy batches, datasets' batches
        columns = {name: batch[name] for name in INPUT_COLUMNS if name in batch}
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"the batch's columns have different lengths: {sorted(lengths)}")
        count = lengths.pop() if lengths else 0
        rows = [{name: values[i] for name, values in columns.items()} for i in range(count)]
    else:
        raise TypeError(
            f"a batch is a dict of columns, a pyarrow Table or a pandas DataFrame, not "
            f"{type(batch).__name__}"
        )
    return [{k: _plain(v) for k, v in row.items() if not _missing(v)} for row in rows]


def _missing(value: Any) -> bool:
    if value is None or type(value).__name__ == "NAType":
        return True
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def _plain(value: Any) -> Any:
    """``value`` without numpy in it (Ray's batches hold arrays of objects, numpy scalars)."""
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
