"""The proxy's own Prometheus metrics, rendered by hand (text exposition format 0.0.4).

The counters live in a :class:`MetricsTable`: one row of 64-bit integers per proxy process. With
``--workers N`` the table is a shared-memory file that every worker maps, each writing only its
own row, and ``/metrics`` (whichever worker answers) renders the sum of all rows; a worker that
uvicorn restarts takes over a dead worker's row and counts on from there, so totals never go
back. With one worker the table is private memory. Updates happen on the event loop thread of
their worker, so no locking is needed beyond claiming a row.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import tempfile
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from vllm_hidden_state_proxy.ring import RingHeader

PREFIX = "hidden_state_proxy_"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

#: Upper bounds (seconds) of the vector-wait histogram buckets; +Inf is implicit.
WAIT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
KINDS = ("ordinary", "flagged", "embeddings")
MISS_REASONS = ("overwritten", "not_published", "engine_without_ring")
#: Why a request's vectors were refused memory: over --max-vectors-size (413), over
#: --vectors-budget (503).
REFUSAL_REASONS = ("request", "budget")

# One row: the owner's pid, then the counters.
_OWNER = 0
_REQUESTS = 1
_FLAGGED = _REQUESTS + len(KINDS)
_MISSES = _FLAGGED + 1
_UPSTREAM_ERRORS = _MISSES + len(MISS_REASONS)
_WAIT_BUCKETS = _UPSTREAM_ERRORS + 1  # len(WAIT_BUCKETS) + 1 cells: the last is above them all
_WAIT_COUNT = _WAIT_BUCKETS + len(WAIT_BUCKETS) + 1
_WAIT_SUM_NS = _WAIT_COUNT + 1
_VECTOR_BYTES = _WAIT_SUM_NS + 1  # a gauge: summed over live rows only
_VECTOR_REFUSALS = _VECTOR_BYTES + 1
_SEND_CUTS = _VECTOR_REFUSALS + len(REFUSAL_REASONS)
CELLS = _SEND_CUTS + 1
#: Rows in a shared table: more workers than this share the last rows' fate (never happens).
ROWS = 256


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MetricsTable:
    """Rows of counters: private (``path`` None) or a shared-memory file of every worker."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        size = ROWS * CELLS * 8
        self._fd: int | None = None
        if path is None:
            self._mm = mmap.mmap(-1, size)
        else:  # a table create_shared made: never through a link, never a file it did not make
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            if os.fstat(self._fd).st_size < size:
                os.close(self._fd)
                raise ValueError(f"{path} is not a metrics table ({size} bytes)")
            self._mm = mmap.mmap(self._fd, size)
        self._cells = memoryview(self._mm).cast("q")

    @classmethod
    def create_shared(cls, directory: str | os.PathLike[str]) -> Path:
        """A fresh, empty shared table file for a server's workers, in a private (0700)
        directory of its own under ``directory``; returns its path (:meth:`remove_shared`).

        The name is not guessable and the file is made with ``O_EXCL | O_NOFOLLOW``: no other
        local user can have put a file or a link there for the workers to write through.
        """
        private = Path(tempfile.mkdtemp(prefix="hidden-state-proxy-metrics-", dir=directory))
        path = private / "table.bin"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, ROWS * CELLS * 8)
        finally:
            os.close(fd)
        return path

    @staticmethod
    def remove_shared(path: Path) -> None:
        """Remove a table :meth:`create_shared` made, and its directory."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def claim_row(self) -> memoryview:
        """This process's row: its own, a dead process's (counting on), or a free one."""
        with self._locked():
            pid = os.getpid()
            free = None
            for row in range(ROWS):
                owner = self._cells[row * CELLS + _OWNER]
                if owner == pid:
                    free = row
                    break
                if free is None and (owner == 0 or not _alive(owner)):
                    free = row
            row = ROWS - 1 if free is None else free
            self._cells[row * CELLS + _OWNER] = pid
        return self._cells[row * CELLS : (row + 1) * CELLS]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def rows(self) -> dict[int, list[int]]:
        """The counters of each claimed row, by the pid that claimed it (index them with the
        cell offsets above)."""
        cells = self._cells
        return {
            cells[base + _OWNER]: cells[base : base + CELLS].tolist()
            for base in range(0, ROWS * CELLS, CELLS)
            if cells[base + _OWNER] != 0
        }

    def totals(self) -> list[int]:
        """Every counter summed over the rows (the owner column is meaningless)."""
        sums = [0] * CELLS
        for row in self.rows().values():
            for cell in range(1, CELLS):
                sums[cell] += row[cell]
        return sums

    def close(self) -> None:
        self._cells.release()
        self._mm.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Counters(Mapping[str, int]):
    """``metrics.requests["flagged"] += 1`` onto a table row (and a read-only mapping)."""

    def __init__(self, row: memoryview, first: int, names: tuple[str, ...]) -> None:
        self._row = row
        self._index = {name: first + i for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> int:
        value: int = self._row[self._index[name]]
        return value

    def __setitem__(self, name: str, value: int) -> None:
        self._row[self._index[name]] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _WaitHistogram:
    def __init__(self, row: memoryview) -> None:
        self._row = row

    @property
    def count(self) -> int:
        value: int = self._row[_WAIT_COUNT]
        return value

    @property
    def total(self) -> float:
        """Seconds observed, summed."""
        return float(self._row[_WAIT_SUM_NS]) / 1e9

    def observe(self, seconds: float) -> None:
        row = self._row
        row[_WAIT_BUCKETS + bisect_left(WAIT_BUCKETS, seconds)] += 1
        row[_WAIT_COUNT] += 1
        row[_WAIT_SUM_NS] += int(seconds * 1e9)


class _RowCell:
    """``metrics.upstream_errors += 1`` onto one cell of the process's table row."""

    def __init__(self, cell: int) -> None:
        self.cell = cell

    def __get__(self, metrics: ProxyMetrics, owner: type[ProxyMetrics]) -> int:
        value: int = metrics.row[self.cell]
        return value

    def __set__(self, metrics: ProxyMetrics, value: int) -> None:
        metrics.row[self.cell] = value


def _label(value: str) -> str:
    """``value`` as a Prometheus label value (the text format's escapes)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ProxyMetrics:
    """This process's counters (a row of ``table``) and the rendering of all rows."""

    def __init__(self, table: MetricsTable | None = None) -> None:
        self.table = table or MetricsTable()
        #: This process's row of the table, where every counter below lives.
        self.row = self.table.claim_row()
        self.requests = _Counters(self.row, _REQUESTS, KINDS)
        #: By reason: "overwritten" (the ring reused the slot before the response was complete:
        #: raise HIDDEN_STATE_PROXY_RING_SLOTS), "not_published", "engine_without_ring".
        self.vector_misses = _Counters(self.row, _MISSES, MISS_REASONS)
        self.vector_wait = _WaitHistogram(self.row)
        #: Requests refused memory for their vectors, by reason (:data:`REFUSAL_REASONS`).
        self.vector_refusals = _Counters(self.row, _VECTOR_REFUSALS, REFUSAL_REASONS)

    #: Flagged requests read and inspected (before any refusal of what they ask for).
    flagged_received = _RowCell(_FLAGGED)
    #: vLLM unreachable, or its reply broke off.
    upstream_errors = _RowCell(_UPSTREAM_ERRORS)
    #: Bytes of vectors and matrices this process holds now (``vectors/memory.py``).
    vector_bytes = _RowCell(_VECTOR_BYTES)
    #: Clients cut off for not taking a reply with vectors in time (``replies.py``).
    send_cuts = _RowCell(_SEND_CUTS)

    def render(
        self,
        *,
        live_rings: Sequence[RingHeader],
        engines_without_ring: int,
        upstream_metrics_up: bool,
    ) -> bytes:
        rows = self.table.rows()
        totals = self.table.totals()
        held = sum(row[_VECTOR_BYTES] for pid, row in rows.items() if _alive(pid))
        cumulative = list(
            itertools.accumulate(totals[_WAIT_BUCKETS : _WAIT_BUCKETS + len(WAIT_BUCKETS)])
        )
        lines = [
            *_family(
                "requests_total",
                "counter",
                "Client requests, by kind (embeddings: the proxy's own /v1/embeddings).",
                *_labelled("kind", KINDS, totals, _REQUESTS),
            ),
            *_family(
                "flagged_requests_total",
                "counter",
                "Chat requests received with return_last_hidden_state: true (including ones "
                "the proxy refused).",
                ("", totals[_FLAGGED]),
            ),
            *_family(
                "vector_misses_total",
                "counter",
                "Flagged requests answered without their hidden state, by reason (overwritten: "
                "the ring reused the slot; not_published; engine_without_ring: an engine of this "
                "vLLM has no ring).",
                *_labelled("reason", MISS_REASONS, totals, _MISSES),
            ),
            *_family(
                "upstream_errors_total",
                "counter",
                "Failed exchanges with vLLM (connect errors, timeouts, broken streams).",
                ("", totals[_UPSTREAM_ERRORS]),
            ),
            *_family(
                "live_rings",
                "gauge",
                "Rings whose worker hook is alive (one per publishing vLLM engine).",
                ("", len(live_rings)),
            ),
            *_family(
                "ring_info",
                "gauge",
                "One per live ring: its vLLM instance and engine, and the vLLM version and "
                "model runner its worker hook wraps.",
                *(
                    (
                        f'{{instance="{header.instance:016x}",engine="{header.engine}",'
                        f'runner="{_label(header.runner)}"}}',
                        1,
                    )
                    for header in live_rings
                ),
            ),
            *_family(
                "engines_without_ring",
                "gauge",
                "vLLM engines whose worker hook could not start its ring (see the proxy's log "
                "and /health).",
                ("", engines_without_ring),
            ),
            *_family(
                "upstream_metrics_up",
                "gauge",
                "1 if this scrape holds vLLM's own metrics, 0 if fetching them failed or timed "
                "out (--metrics-upstream-timeout).",
                ("", int(upstream_metrics_up)),
            ),
            *_family(
                "vector_bytes",
                "gauge",
                "Bytes of vectors and matrices the proxy holds now (each process against its "
                "--vectors-budget).",
                ("", held),
            ),
            *_family(
                "vector_refusals_total",
                "counter",
                "Requests refused memory for their vectors, by reason (request: over "
                "--max-vectors-size, 413; budget: over --vectors-budget, 503).",
                *_labelled("reason", REFUSAL_REASONS, totals, _VECTOR_REFUSALS),
            ),
            *_family(
                "send_cuts_total",
                "counter",
                "Connections cut because the client did not take an answer that carries "
                "vectors in time (--send-timeout).",
                ("", totals[_SEND_CUTS]),
            ),
            *_family(
                "vector_wait_seconds",
                "histogram",
                "Time from vLLM's 200 until the hidden state was found in the ring.",
                *(
                    (f'_bucket{{le="{bound!r}"}}', count)
                    for bound, count in zip(WAIT_BUCKETS, cumulative, strict=True)
                ),
                ('_bucket{le="+Inf"}', totals[_WAIT_COUNT]),
                ("_sum", f"{totals[_WAIT_SUM_NS] / 1e9!r}"),
                ("_count", totals[_WAIT_COUNT]),
            ),
        ]
        return ("\n".join(lines) + "\n").encode("utf-8")


def _family(name: str, kind: str, help: str, *samples: tuple[str, object]) -> list[str]:
    """One metric family in Prometheus' text format: its HELP and TYPE lines, then a line per
    sample (what follows the name: a suffix, labels; and the value)."""
    full = f"{PREFIX}{name}"
    return [
        f"# HELP {full} {help}",
        f"# TYPE {full} {kind}",
        *(f"{full}{tail} {value}" for tail, value in samples),
    ]


def _labelled(
    label: str, names: tuple[str, ...], totals: Sequence[int], first: int
) -> Iterator[tuple[str, object]]:
    """A counter's samples by ``label``: one per name, its count in ``totals[first + i]``."""
    return ((f'{{{label}="{name}"}}', totals[first + i]) for i, name in enumerate(names))
