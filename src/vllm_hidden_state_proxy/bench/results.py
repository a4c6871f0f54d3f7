"""What a run found, as plain dataclasses (JSON via ``dataclasses.asdict``).

Every measured thing is an *arm* with a ``status``: ``ok`` (measured), ``unsupported`` (the
server refused what the arm asks for, e.g. a vector format it does not know yet) or
``skipped`` (not run: nginx absent, ``--smoke``...), and a ``note`` saying why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from vllm_hidden_state_proxy.bench.stats import Summary, percentile

Status = Literal["ok", "unsupported", "skipped"]


@dataclass
class ArmHeader:
    """What every arm has: its name, what it measures, its status and why."""

    name: str
    description: str
    status: Status = "ok"
    note: str = ""


@dataclass
class LatencyArm(ArmHeader):
    """One-token chat requests, one at a time."""

    latency_ms: Summary | None = None

    kind: ClassVar[str] = "latency"


@dataclass
class StreamArm(ArmHeader):
    """Streamed requests: time to first token, the gaps between tokens, time to last token."""

    ttft_ms: Summary | None = None
    #: Every gap between consecutive token events, pooled over the arm's streams.
    itl_ms: Summary | None = None
    #: Mean inter-token latency: all (last - first token) time over all gaps.
    itl_mean_ms: float | None = None
    #: Time to the last token.
    ttlt_ms: Summary | None = None
    #: Streams whose tokens arrived in one burst (see ``client.StreamTiming.burst``).
    burst_streams: int = 0
    tokens_per_request: int = 0

    kind: ClassVar[str] = "streaming"


@dataclass
class ThroughputPoint:
    concurrency: int
    requests: int
    seconds: float
    requests_per_second: float
    latency_ms: Summary
    #: Requests per second in each round, in round order.
    rounds_rps: list[float] = field(default_factory=list)


@dataclass
class ThroughputArm(ArmHeader):
    """Requests per second with N requests in flight, for each N of the sweep."""

    points: list[ThroughputPoint] = field(default_factory=list)

    kind: ClassVar[str] = "throughput"

    def at(self, concurrency: int) -> ThroughputPoint | None:
        return next((p for p in self.points if p.concurrency == concurrency), None)


def median_of_pairs(rates: list[float], baseline_rates: list[float]) -> float | None:
    """Median over rounds of ``rates[i] / baseline_rates[i]`` (rounds with a rate of 0 in the
    baseline left out); None when no round pairs up."""
    pairs = [a / b for a, b in zip(rates, baseline_rates, strict=False) if b > 0]
    return percentile(pairs, 50) if pairs else None


def paired_ratio(arm: ThroughputArm, baseline: ThroughputArm, concurrency: int) -> float | None:
    """Median over rounds of (``arm``'s rate / ``baseline``'s rate in the same round)."""
    mine, theirs = arm.at(concurrency), baseline.at(concurrency)
    if mine is None or theirs is None:
        return None
    return median_of_pairs(mine.rounds_rps, theirs.rounds_rps)


@dataclass
class EmbeddingsPoint:
    """One batch size of the embeddings phase: ``requests`` requests of ``batch_size`` inputs
    each, one request at a time (for the direct arm: ``batch_size`` chats at once, the fan-out
    the proxy does, as one "request")."""

    batch_size: int
    requests: int
    inputs: int
    seconds: float
    inputs_per_second: float
    requests_per_second: float
    #: Per request (all its inputs answered).
    latency_ms: Summary
    #: Inputs per second in each round, in round order.
    rounds_ips: list[float] = field(default_factory=list)
    #: The proxy's CPU milliseconds per input (None: not this arm, or not on this machine).
    proxy_cpu_ms_per_input: float | None = None


@dataclass
class EmbeddingsArm(ArmHeader):
    """Embeddings per second at each batch size: through the proxy's ``/v1/embeddings``, or
    the same one-token chats straight to vLLM (the baseline)."""

    hidden_size: int | None = None
    points: list[EmbeddingsPoint] = field(default_factory=list)

    kind: ClassVar[str] = "embeddings"

    def at(self, batch_size: int) -> EmbeddingsPoint | None:
        return next((p for p in self.points if p.batch_size == batch_size), None)


def paired_embeddings_ratio(
    arm: EmbeddingsArm, baseline: EmbeddingsArm, batch_size: int
) -> float | None:
    """Median over rounds of (``arm``'s inputs/s / ``baseline``'s in the same round)."""
    mine, theirs = arm.at(batch_size), baseline.at(batch_size)
    if mine is None or theirs is None:
        return None
    return median_of_pairs(mine.rounds_ips, theirs.rounds_ips)


@dataclass
class PoolingArm(ArmHeader):
    """A second vLLM server (``--runner pooling``, LAST pooling) serving the same model."""

    latency_ms: Summary | None = None
    rss_mib: float | None = None
    pss_mib: float | None = None
    startup_seconds: float | None = None
    prompts_compared: int = 0
    cosine_min: float | None = None
    cosine_mean: float | None = None
    #: |ours| / |theirs|: 1.0 when neither side normalises.
    norm_ratio_mean: float | None = None
    prompt_tokens_match: bool | None = None

    kind: ClassVar[str] = "pooling"


Arm = LatencyArm | StreamArm | ThroughputArm | PoolingArm | EmbeddingsArm
_ArmT = TypeVar("_ArmT", bound=ArmHeader)


@dataclass
class RingPoint:
    """Ring microbenchmark for one hidden size, in µs per operation."""

    hidden_size: int
    publish_us: Summary
    lookup_us: Summary
    #: The proxy's work after a lookup: record -> floats, floats -> JSON, or bytes -> base64.
    as_floats_us: Summary
    json_us: Summary
    base64_us: Summary

    @property
    def publish_lookup_p50(self) -> float:
        return self.publish_us.p50 + self.lookup_us.p50


@dataclass
class CpuCost:
    """CPU milliseconds per request of one arm (None: that process is not on this machine)."""

    arm: str
    requests: int
    proxy_ms: float | None
    #: vLLM's API server, engine core and workers together.
    vllm_ms: float | None


@dataclass
class Memory:
    """Resident memory in MiB (None: not measurable, e.g. a proxy on another machine)."""

    proxy_rss_idle_mib: float | None = None
    proxy_rss_peak_mib: float | None = None
    #: The proxy's peak during the embeddings phase (up to 256 inputs a request).
    proxy_rss_peak_embeddings_mib: float | None = None
    vllm_rss_mib: float | None = None
    vllm_pss_mib: float | None = None


@dataclass
class TargetCheck:
    label: str
    value: float | None
    op: Literal["<=", ">="]
    limit: float
    unit: str = ""
    #: Why the value may not mean what its label says (e.g. every stream came in one burst).
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit


@dataclass
class BenchResults:
    meta: dict[str, Any]
    arms: dict[str, Arm] = field(default_factory=dict)
    ring: list[RingPoint] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)
    cpu: list[CpuCost] = field(default_factory=list)
    targets: list[TargetCheck] = field(default_factory=list)
    #: Informative ratios (no target), label -> value.
    ratios: dict[str, float | None] = field(default_factory=dict)

    def add(self, arm: Arm) -> None:
        self.arms[arm.name] = arm

    def arms_of(self, kind: type[_ArmT]) -> dict[str, _ArmT]:
        """The arms of one kind, by name, in the order they were added."""
        return {name: arm for name, arm in self.arms.items() if isinstance(arm, kind)}

    def latency(self, name: str) -> Summary | None:
        arm = self.arms.get(name)
        if isinstance(arm, LatencyArm) and arm.status == "ok":
            return arm.latency_ms
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "arms": {name: {"kind": arm.kind, **asdict(arm)} for name, arm in self.arms.items()},
            "ring": [
                {**asdict(point), "publish_lookup_p50_us": point.publish_lookup_p50}
                for point in self.ring
            ],
            "memory": asdict(self.memory),
            "cpu": [asdict(cost) for cost in self.cpu],
            "targets": [{**asdict(check), "passed": check.passed} for check in self.targets],
            "ratios": self.ratios,
        }
