"""A fake batch over many steps, and the records its flagged requests must get.

:func:`simulate` schedules :class:`Ask` s (a client's request: its prompt, pooling, layers,
``n``) as vLLM's scheduler would, within a token budget per step: chunked prefill, decode one
token a step, a request finished once it sampled ``max_tokens`` tokens (and named in the next
step's ``finished_req_ids``), preemption (its tokens computed again from position 0, prompt and
answer so far, when it resumes: V2 sends it as a new request again), prefix-cache hits (the
first positions not computed). :func:`expected_records` says, from the asks and the model's
reference alone, what the ring must hold for each key once every request finished; it knows
nothing of the schedule, so a vector taken from a wrong row or step, or a position summed twice,
does not match it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.gpu.batch import NewRequest, Scheduled, Step
from tests.gpu.model import CAPTURED, FINAL, MODEL, MatmulModel, seed_of
from vllm_hidden_state_proxy.protocol import (
    ANSWER_WINDOW,
    CHOICES_ENTRY,
    LAYERS_ENTRY,
    POOLING_ENTRY,
    REQUEST_KEY_ENTRY,
    SPANS_ENTRY,
    all_answer_key,
    answer_key,
)
from vllm_hidden_state_proxy.ring import ErrorRecord, Found, Record, RingReader, RingWriter


def key(number: int) -> bytes:
    return number.to_bytes(16, "big")


@dataclass(frozen=True)
class Ask:
    """One request as a client sends it: ``n`` choices of one prompt (``pooling`` ``None``:
    not flagged, ordinary traffic)."""

    name: str
    prompt_len: int
    pooling: str | None = "last"
    key: bytes = b""
    layers: tuple[int, ...] = (FINAL,)
    n: int = 1
    max_tokens: int = 4
    arrival: int = 0
    #: Positions served from the prefix cache when first scheduled.
    prefix_hit: int = 0
    #: Steps at which it is preempted, if running then.
    preempt_at: tuple[int, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()

    def req_ids(self) -> list[str]:
        """vLLM's request ids: ``"<index>_<parent>"`` for each choice when ``n > 1``."""
        return [self.name] if self.n == 1 else [f"{i}_{self.name}" for i in range(self.n)]

    def extra_args(self) -> dict[str, Any] | None:
        if self.pooling is None:
            return None
        args: dict[str, Any] = {
            REQUEST_KEY_ENTRY: self.key.hex(),
            LAYERS_ENTRY: list(self.layers),
            POOLING_ENTRY: self.pooling,
        }
        if self.n > 1:
            args[CHOICES_ENTRY] = self.n
        if self.spans:
            args[SPANS_ENTRY] = [p for span in self.spans for p in span]
        return args


@dataclass
class _Live:
    ask: Ask
    req_id: str
    state: str = "waiting"  # running, preempted, finished
    computed: int = 0
    outputs: int = 0
    resume_at: int = 0


@dataclass
class _StepPlan:
    """One step being scheduled: its batch and new requests, and the tokens still free."""

    left: int
    batch: list[Scheduled] = field(default_factory=list)
    new: dict[str, NewRequest] = field(default_factory=dict)

    def schedule(self, request: _Live, is_new: bool) -> None:
        ask = request.ask
        tokens = min(ask.prompt_len + request.outputs - request.computed, self.left)
        if tokens <= 0:
            return
        self.batch.append(
            Scheduled(request.req_id, ask.prompt_len, request.computed, tokens, ask.name)
        )
        if is_new:
            self.new[request.req_id] = NewRequest(ask.extra_args(), ask.max_tokens)
        request.state = "running"
        self.left -= tokens


def simulate(
    asks: Sequence[Ask],
    *,
    budget: int,
    resume_after: int = 3,
    seen: Counter[str] | None = None,
) -> list[Step]:
    """The steps vLLM's scheduler would run for ``asks`` with ``budget`` tokens a step:
    running requests first, then resumed ones, then new arrivals; until every request has
    finished and been named finished. ``seen`` counts what happened (``"preempted in its
    prompt"``, ``"preempted in its answer"``, ``"prefix-cache hit"``, ``"prompt chunk"``)."""
    seen = Counter() if seen is None else seen
    live = [_Live(ask, req_id) for ask in asks for req_id in ask.req_ids()]
    by_id = {request.req_id: request for request in live}
    steps: list[Step] = []
    to_report: list[str] = []
    number = 0
    while to_report or any(request.state != "finished" for request in live):
        finished, to_report = to_report, []
        for request in live:
            if request.state == "running" and number in request.ask.preempt_at:
                in_prompt = request.computed < request.ask.prompt_len
                seen["preempted in its prompt" if in_prompt else "preempted in its answer"] += 1
                request.state, request.computed = "preempted", 0
                request.resume_at = number + resume_after
        plan = _StepPlan(budget)
        for request in [r for r in live if r.state == "running"]:
            plan.schedule(request, False)
        for request in [r for r in live if r.state == "preempted" and r.resume_at <= number]:
            plan.schedule(request, True)  # V2: a resumed request is scheduled as a new one
        for request in [r for r in live if r.state == "waiting" and r.ask.arrival <= number]:
            request.computed = request.ask.prefix_hit
            seen["prefix-cache hit"] += request.computed > 0
            plan.schedule(request, True)
        for item in plan.batch:
            request = by_id[item.req_id]
            request.computed += item.scheduled
            seen["prompt chunk"] += request.computed < item.prompt_len
            if request.computed == item.prompt_len + request.outputs:  # samples a token
                request.outputs += 1
                if request.outputs == request.ask.max_tokens:
                    request.state = "finished"
                    to_report.append(request.req_id)
        steps.append(Step(plan.batch, plan.new, finished))
        number += 1
        if number > 100_000:
            raise AssertionError("the fake scheduler does not finish")
    return steps


# -- what the ring must hold ------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    pooling: str
    layers: tuple[int, ...]
    position: int
    num_prompt_tokens: int
    rows: int
    #: float64 ``[len(layers) * rows, hidden]``, layer after layer.
    values: np.ndarray[Any, Any]
    #: ``None``: every value exactly (a copy); else the absolute tolerance (a mean in float32).
    tolerance: float | None = None


@dataclass(frozen=True)
class ExpectedError:
    status: int
    text: str


Want = Expected | ExpectedError


def _mean_tolerance(summed: np.ndarray[Any, Any], count: int) -> float:
    """How far a float32 mean of ``count`` of the ``summed`` rows may be from the exact one:
    a float32 sum of ``count`` values errs by at most about ``count * 6e-8`` times their
    largest magnitude times ``count``, so the mean by ``count * 6e-8`` times it; this allows
    16 times that. A row too many or too few moves the mean by about a row's size over
    ``count``, far more."""
    return 1e-6 * count * max(1.0, float(np.abs(summed).max(initial=0.0)))


def _rows(
    model: MatmulModel, identity: str, positions: Sequence[int], layer: int
) -> np.ndarray[Any, Any]:
    return model.reference([seed_of(identity, position) for position in positions], layer)


def _answer_rows(
    model: MatmulModel, ask: Ask, req_id: str, positions: Sequence[int], layer: int
) -> np.ndarray[Any, Any]:
    """A choice's rows: its prompt's up to the prompt's last position, then its own."""
    return np.vstack(
        [_rows(model, ask.name if q < ask.prompt_len else req_id, [q], layer) for q in positions]
    )


def expected_records(asks: Sequence[Ask], model: MatmulModel) -> dict[bytes, Want]:
    """Every record key the flagged ``asks`` must get, with what it must hold."""
    wanted: dict[bytes, Want] = {}
    for ask in asks:
        if ask.pooling is None:
            continue
        prompt = ask.prompt_len
        prompt_rows = {layer: _rows(model, ask.name, range(prompt), layer) for layer in ask.layers}
        if ask.pooling == "last":
            values = np.vstack([prompt_rows[layer][-1:] for layer in ask.layers])
            wanted[ask.key] = Expected("last", ask.layers, prompt - 1, prompt, 1, values)
        elif ask.pooling == "mean":
            if ask.prefix_hit:
                wanted[ask.key] = ExpectedError(409, "served from the prefix cache")
                continue
            values = np.vstack([prompt_rows[layer].mean(axis=0) for layer in ask.layers])
            tolerance = _mean_tolerance(np.vstack(list(prompt_rows.values())), prompt)
            wanted[ask.key] = Expected("mean", ask.layers, prompt - 1, prompt, 1, values, tolerance)
        elif ask.pooling == "spans":
            if any(end > prompt for _, end in ask.spans):
                wanted[ask.key] = ExpectedError(400, "ends past the prompt")
                continue
            values = np.vstack(
                [
                    prompt_rows[layer][start:end].mean(axis=0)
                    for layer in ask.layers
                    for start, end in ask.spans
                ]
            )
            longest = max(end - start for start, end in ask.spans)
            tolerance = _mean_tolerance(np.vstack(list(prompt_rows.values())), longest)
            spans = len(ask.spans)
            wanted[ask.key] = Expected("spans", ask.layers, 0, prompt, spans, values, tolerance)
        elif ask.pooling == "all_prompt":
            values = np.vstack([prompt_rows[layer] for layer in ask.layers])
            wanted[ask.key] = Expected("all_prompt", ask.layers, 0, prompt, prompt, values)
        else:  # the answer's poolings: each choice its own records
            # The positions that chose a token: the prompt's last, then each fed-back token.
            sampled = list(range(prompt - 1, prompt + ask.max_tokens - 1))
            for choice, req_id in enumerate(ask.req_ids()):
                if ask.pooling == "all_answer":
                    values = np.vstack(
                        [_answer_rows(model, ask, req_id, sampled, layer) for layer in ask.layers]
                    )
                    wanted[all_answer_key(ask.key, choice)] = Expected(
                        "all_answer", ask.layers, prompt - 1, prompt, len(sampled), values
                    )
                    continue
                for q in sampled[-ANSWER_WINDOW:]:
                    values = np.vstack(
                        [_answer_rows(model, ask, req_id, [q], layer) for layer in ask.layers]
                    )
                    wanted[answer_key(ask.key, choice, q - prompt + 2)] = Expected(
                        "last_answer", ask.layers, q, prompt, 1, values
                    )
    return wanted


# -- the ring, read back ---------------------------------------------------------------------


@dataclass(frozen=True)
class Got:
    """A record read back, copied out of the ring (which may be closed since)."""

    pooling: str
    layers: tuple[int, ...]
    position: int
    num_prompt_tokens: int
    rows: int
    data: bytes

    def values(self, hidden: int) -> np.ndarray[Any, Any]:
        values: np.ndarray[Any, Any] = np.frombuffer(self.data, dtype="<f4").reshape(-1, hidden)
        return values


@dataclass(frozen=True)
class GotError:
    status: int
    message: str


Read = Got | GotError | None


def _copied(found: Found | None) -> Read:
    if isinstance(found, ErrorRecord):
        return GotError(found.status, found.message)
    if isinstance(found, Record):
        return Got(
            found.pooling,
            found.layers,
            found.position,
            found.num_prompt_tokens,
            found.rows,
            bytes(found.vectors),
        )
    return None


@dataclass
class Ring:
    writer: RingWriter
    reader: RingReader
    read: dict[bytes, Read] = field(default_factory=dict)

    def read_back(self, keys: Sequence[bytes] | Mapping[bytes, Any]) -> dict[bytes, Read]:
        return {k: _copied(self.reader.lookup(k)) for k in keys}


@contextmanager
def ring(
    directory: Path,
    hidden: int,
    *,
    layers: tuple[int, ...] = CAPTURED.layers,
    slots: int = 1024,
    arena_mib: int = 16,
) -> Iterator[Ring]:
    """A real ring of ``hidden``-d records (and its reader), closed afterwards."""
    writer = RingWriter.create(
        directory,
        hidden_size=hidden,
        model=MODEL,
        slot_count=slots,
        instance=0x4949,
        num_hidden_layers=FINAL,
        layers=layers,
        arena_size=arena_mib << 20,
    )
    try:
        reader = RingReader.open(writer.path)
        try:
            yield Ring(writer, reader)
        finally:
            reader.close()
    finally:
        writer.close()


def check_records(got: Mapping[bytes, Read], wanted: Mapping[bytes, Want], hidden: int) -> None:
    """Each wanted key's record is there and holds what it must."""
    problems = []
    for k, want in wanted.items():
        read = got.get(k)
        if isinstance(want, ExpectedError):
            if not (isinstance(read, GotError) and read.status == want.status):
                problems.append(f"{k.hex()}: {read!r}, not an error {want.status}")
            elif want.text not in read.message:
                problems.append(f"{k.hex()}: {read.message!r} lacks {want.text!r}")
            continue
        if not isinstance(read, Got):
            problems.append(f"{k.hex()}: {read!r}, not a {want.pooling} record")
            continue
        fields = (read.pooling, read.layers, read.position, read.num_prompt_tokens, read.rows)
        wanted_fields = (want.pooling, want.layers, want.position, want.num_prompt_tokens)
        if fields != (*wanted_fields, want.rows):
            problems.append(f"{k.hex()}: {fields} != {(*wanted_fields, want.rows)}")
            continue
        values = read.values(hidden)
        if want.tolerance is None:
            bad = values.shape != want.values.shape or not np.array_equal(values, want.values)
        else:
            bad = values.shape != want.values.shape or not np.allclose(
                values, want.values, rtol=0, atol=want.tolerance
            )
        if bad:
            problems.append(f"{k.hex()}: the {want.pooling} values differ from the reference")
    assert not problems, f"{len(problems)} of {len(wanted)} records wrong:\n" + "\n".join(
        problems[:20]
    )


def check_same(
    first: Mapping[bytes, Read], second: Mapping[bytes, Read], wanted: Mapping[bytes, Want]
) -> None:
    """Two runs' records (CPU and CUDA) agree: copies to the bit, means within tolerance."""
    assert first.keys() == second.keys()
    for k, want in wanted.items():
        a, b = first[k], second[k]
        if isinstance(a, Got) and isinstance(b, Got) and isinstance(want, Expected):
            assert a.pooling == b.pooling and a.rows == b.rows, k.hex()
            if want.tolerance is None:
                assert a == b, f"{k.hex()}: the {want.pooling} records differ"
            else:
                np.testing.assert_allclose(
                    np.frombuffer(a.data, "<f4"),
                    np.frombuffer(b.data, "<f4"),
                    rtol=0,
                    atol=2 * want.tolerance,
                    err_msg=k.hex(),
                )
        else:
            assert a == b, f"{k.hex()}: {a!r} != {b!r}"


def pipeline_asks(count: int = 48, seed: int = 49) -> list[Ask]:
    """A mixed load: every pooling, ``n`` of 1 to 3, chunked prompts, prefix-cache hits,
    preemptions, unflagged requests between, arrivals every few steps (a few hundred steps at a
    budget of 32 tokens)."""
    rng = random.Random(seed)
    poolings = ("last", "mean", "spans", "all_prompt", "last_answer", "all_answer")
    layer_choices = [(FINAL,), (0, FINAL), (0, 2, FINAL), (2,)]
    asks = []
    arrival = 0
    for i in range(count):
        pooling = poolings[i % len(poolings)]
        prompt = rng.randint(2, 40)
        spans: tuple[tuple[int, int], ...] = ()
        if pooling == "spans":
            start, end = sorted(rng.sample(range(prompt + 1), 2))
            spans = ((start, end), (0, prompt))
        asks.append(
            Ask(
                f"r{i}",
                prompt,
                pooling,
                key(i + 1),
                rng.choice(layer_choices),
                n=3 if i % 9 == 4 else 2 if i % 4 == 0 else 1,
                max_tokens=rng.randint(1, 12),
                arrival=arrival,
                prefix_hit=rng.randint(1, prompt - 1) if pooling == "last" and i % 2 == 0 else 0,
                # Every other round of poolings is preempted a few steps after it arrives.
                preempt_at=(arrival + rng.randint(1, 6),) if i // len(poolings) % 2 else (),
                spans=spans,
            )
        )
        asks.append(
            Ask(
                f"plain{i}",
                rng.randint(1, 30),
                None,
                max_tokens=rng.randint(1, 20),
                arrival=arrival + rng.randint(0, 3),
            )
        )
        arrival += rng.randint(2, 7)
    # What the hook answers with an error record: a mean whose first positions came from the
    # prefix cache, a span past the prompt.
    asks.append(Ask("hit-mean", 20, "mean", key(1001), prefix_hit=8, arrival=5))
    asks.append(Ask("far-span", 6, "spans", key(1002), spans=((2, 9),), arrival=9))
    # Long prompts preempted half-way through their prefill: the positions computed again
    # after the resume must not count twice.
    for i, pooling in enumerate(poolings):
        asks.append(
            Ask(
                f"long-{pooling}",
                90,
                pooling,
                key(2001 + i),
                (0, 2, FINAL),
                n=2 if i % 2 else 1,
                max_tokens=10,
                arrival=20 + 30 * i,
                preempt_at=(22 + 30 * i,),
                spans=((3, 50), (40, 90)) if pooling == "spans" else (),
            )
        )
    return asks
