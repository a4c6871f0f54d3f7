"""Soak (issue #7): thousands of mixed requests through the proxy, 16 at a time, on loopback.

Every kind of request the proxy serves is in the mix: flagged and ordinary chat, streamed and
not, flagged n=2, flagged completions (one prompt and a list of three), /v1/embeddings. The
run is bounded (a fixed count, ``SOAK_REQUESTS``) and checks, at the end:

- no request lost or failed (every answer a complete 200 of the right shape, no 5xx);
- no vector misattributed: every flagged prompt is unique, is sent twice (once in each half of
  the run, in another format and, for lists, another position) and must get the same vector
  both times, while every other prompt's vector differs; a sample is checked against
  Transformers;
- the proxy's resident memory is flat after a warm-up.

Figures (requests/s, p50/p99 latency per kind, RSS) are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import MIN_COSINE, Reference, assert_matches
from tests.e2e.server import RunningStack
from tests.e2e.stack_probe import MIB, metric, proxy_process, rss
from vllm_hidden_state_proxy.protocol import DEFAULT_TEMPLATE

#: Requests in one soak run (about 80 s on 2 cores; SOAK_REQUESTS changes it).
REQUESTS = int(os.environ.get("SOAK_REQUESTS", "5000"))
CONCURRENCY = 16
#: Requests sent before the proxy's memory is first measured.
WARM_UP = max(100, REQUESTS // 5)
#: Most the proxy's RSS may grow between the end of the warm-up and the end of the run.
MAX_RSS_GROWTH = 4 * MIB
#: Flagged prompts checked against Transformers (all are checked against their twin).
REFERENCE_SAMPLE = 200

#: Share of each kind in the mix.
MIX = {
    "flagged_chat": 0.20,
    "chat": 0.14,
    "flagged_stream": 0.14,
    "stream": 0.10,
    "flagged_n2": 0.10,
    "flagged_completion": 0.10,
    "flagged_completion_list": 0.10,
    "embeddings": 0.12,
}
#: Kinds that send no vector request (the rest carry unique prompts, each sent twice).
ORDINARY = ("chat", "stream")
#: How a flagged kind's prompt becomes a vector (see ``expected_vector``).
PROMPT_KIND = {
    "flagged_chat": "chat",
    "flagged_stream": "chat",
    "flagged_n2": "chat",
    "flagged_completion": "completion",
    "flagged_completion_list": "completion",
    "embeddings": "embedding",
}
FORMATS = ("float", "base64")
#: Prompts per request of a kind (a list of completions prompts, embeddings inputs).
PROMPTS_PER_REQUEST = {"flagged_completion_list": 3, "embeddings": 2}

VOCABULARY = (
    "amber basalt cedar delta ember fjord garnet harbor iris juniper kelp lagoon meadow "
    "nectar onyx pebble quartz river saffron tundra umber violet willow xenon yarrow zephyr"
)
WORDS = VOCABULARY.split()


@dataclass(frozen=True)
class Prompt:
    """One unique flagged prompt (text) and how its vector is made."""

    id: int
    kind: str  # "chat", "completion" or "embedding"
    text: str


@dataclass
class Call:
    kind: str
    path: str
    body: dict[str, Any]
    prompts: list[Prompt]  # in the order the answer lists their vectors
    stream: bool = False
    n: int = 1


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failures: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    vectors: dict[int, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))


def flag(fmt: str) -> dict[str, Any]:
    return {"return_last_hidden_state": True, "last_hidden_state_format": fmt}


def decode(value: Any) -> np.ndarray:
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float64)
    return np.asarray(value, dtype=np.float64)


def plan(model: str, rng: random.Random) -> list[Call]:
    """The whole run: phase one (first sends) then phase two (second sends), each shuffled,
    ordinary requests spread over both."""
    counts = {kind: 2 * round(share * REQUESTS / 2) for kind, share in MIX.items()}
    counts["chat"] += REQUESTS - sum(counts.values())
    next_id = iter(range(10**9))

    def new_prompt(kind: str) -> Prompt:
        words = " ".join(rng.choice(WORDS) for _ in range(6))
        i = next(next_id)
        return Prompt(i, PROMPT_KIND[kind], f"Soak {kind} #{i}: {words}.")

    def chat_call(kind: str, prompt: Prompt | None, fmt: str, *, stream: bool, n: int = 1) -> Call:
        text = prompt.text if prompt else f"Ordinary {kind}: {rng.choice(WORDS)}"
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_completion_tokens": 4,
            "n": n,
            "stream": stream,
            **NO_THINKING,
        }
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if prompt:
            body["kv_transfer_params"] = flag(fmt)
        return Call(kind, "/v1/chat/completions", body, [prompt] if prompt else [], stream, n)

    def make(kind: str, prompts: list[Prompt], fmt: str) -> Call:
        if kind == "flagged_chat":
            return chat_call(kind, prompts[0], fmt, stream=False)
        if kind == "flagged_stream":
            return chat_call(kind, prompts[0], fmt, stream=True)
        if kind == "flagged_n2":
            return chat_call(kind, prompts[0], fmt, stream=False, n=2)
        if kind == "embeddings":
            inputs = [p.text for p in prompts]
            embed = {"model": model, "input": inputs, "encoding_format": fmt}
            return Call(kind, "/v1/embeddings", embed, prompts)
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompts[0].text
            if kind == "flagged_completion"
            else [p.text for p in prompts],
            "max_tokens": 2,
            "kv_transfer_params": flag(fmt),
        }
        return Call(kind, "/v1/completions", body, prompts)

    first: list[Call] = []
    second: list[Call] = []
    for kind, count in counts.items():
        if kind in ORDINARY:
            calls = [chat_call(kind, None, "", stream=kind == "stream") for _ in range(count)]
            first += calls[: count // 2]
            second += calls[count // 2 :]
            continue
        for _ in range(count // 2):
            prompts = [new_prompt(kind) for _ in range(PROMPTS_PER_REQUEST.get(kind, 1))]
            fmt, other = rng.sample(FORMATS, 2)
            first.append(make(kind, prompts, fmt))
            # The twin: later, in the other format, lists in reverse order.
            second.append(make(kind, prompts[::-1], other))
    rng.shuffle(first)
    rng.shuffle(second)
    return first + second


def check_json(call: Call, payload: dict[str, Any]) -> list[np.ndarray]:
    """The vectors of a non-streamed answer, in ``call.prompts`` order (asserts its shape)."""
    if call.kind == "chat":
        assert payload["choices"] and not payload.get("kv_transfer_params"), payload
        return []
    if call.kind == "embeddings":
        data = payload["data"]
        assert [d["index"] for d in data] == list(range(len(call.prompts))), data
        vectors = [decode(d["embedding"]) for d in data]
        for vector in vectors:
            assert abs(np.linalg.norm(vector) - 1.0) < 1e-4
        return vectors
    kv = payload["kv_transfer_params"]
    expected_choices = call.n * len(call.prompts)
    assert [c["index"] for c in payload["choices"]] == list(range(expected_choices)), payload
    if call.kind == "flagged_completion_list":
        return [decode(v) for v in kv["last_hidden_states"]]
    return [decode(kv["last_hidden_state"])]


def check_stream(call: Call, text: str) -> list[np.ndarray]:
    events = [e for e in text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    carriers = [i for i, c in enumerate(chunks) if c.get("kv_transfer_params")]
    if not call.prompts:
        assert not carriers
        return []
    first_choice = next(i for i, c in enumerate(chunks) if c["choices"])
    assert carriers == [first_choice], carriers
    return [decode(chunks[first_choice]["kv_transfer_params"]["last_hidden_state"])]


async def send(client: httpx.AsyncClient, call: Call, tally: Tally) -> None:
    start = time.perf_counter()
    try:
        if call.stream:
            async with client.stream("POST", call.path, json=call.body) as response:
                content = (await response.aread()).decode()
        else:
            response = await client.post(call.path, json=call.body)
            content = response.text
    except httpx.HTTPError as exc:
        tally.failures.append(f"{call.kind}: lost ({exc!r})")
        return
    elapsed = time.perf_counter() - start
    tally.statuses[response.status_code] += 1
    if response.status_code != 200:
        tally.failures.append(f"{call.kind}: {response.status_code} {content[:300]}")
        return
    try:
        if call.stream:
            vectors = check_stream(call, content)
        else:
            vectors = check_json(call, json.loads(content))
        assert len(vectors) == len(call.prompts)
    except (AssertionError, KeyError, ValueError, StopIteration) as exc:
        tally.failures.append(f"{call.kind}: malformed answer ({exc!r}): {content[:300]}")
        return
    tally.latencies[call.kind].append(elapsed)
    for prompt, vector in zip(call.prompts, vectors, strict=True):
        tally.vectors[prompt.id].append(vector)


async def run_calls(base_url: str, calls: list[Call], tally: Tally) -> float:
    """Send ``calls`` ``CONCURRENCY`` at a time, in order; the wall time."""
    queue = iter(calls)
    # Retire idle connections before the proxy's 5 s keep-alive closes them.
    limits = httpx.Limits(max_connections=CONCURRENCY, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for call in queue:
                await send(client, call, tally)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def expected_vector(reference: Reference, prompt: Prompt) -> list[float]:
    if prompt.kind == "completion":
        return reference.last_hidden_state(reference.tokenizer(prompt.text)["input_ids"])
    text = prompt.text
    if prompt.kind == "embedding":
        text = DEFAULT_TEMPLATE.replace("{text}", text)
    ids = reference.chat_token_ids([{"role": "user", "content": text}], enable_thinking=False)
    vector = reference.last_hidden_state(ids)
    if prompt.kind == "embedding":
        norm = float(np.linalg.norm(vector))
        vector = [v / norm for v in vector]
    return vector


def unit_rows(vectors: list[np.ndarray]) -> np.ndarray:
    matrix = np.stack(vectors)
    unit: np.ndarray = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
    return unit


def test_soak_mixed_load_no_loss_no_misattribution_flat_memory(
    stack: RunningStack,
    model_name: str,
    reference: Reference,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = random.Random(7)
    calls = plan(model_name, rng)
    assert len(calls) == REQUESTS
    prompts = {p.id: p for call in calls for p in call.prompts}
    proxy = proxy_process(stack)
    tally = Tally()
    rss_samples: list[tuple[int, float]] = [(0, rss(proxy) / MIB)]

    warm_up_time = asyncio.run(run_calls(stack.proxy_url, calls[:WARM_UP], tally))
    rss_after_warm_up = rss(proxy)
    rss_samples.append((WARM_UP, rss_after_warm_up / MIB))

    rest = calls[WARM_UP:]
    step = max(1, len(rest) // 4)
    run_time = 0.0
    for offset in range(0, len(rest), step):
        run_time += asyncio.run(run_calls(stack.proxy_url, rest[offset : offset + step], tally))
        rss_samples.append((WARM_UP + min(offset + step, len(rest)), rss(proxy) / MIB))
    rss_at_end = rss(proxy)
    rss_samples.append((REQUESTS, rss_at_end / MIB))

    # --- twins agree, strangers differ ------------------------------------------------------
    twins = [(pid, pair) for pid, pair in tally.vectors.items() if len(pair) == 2]
    missing = [pid for pid in prompts if len(tally.vectors.get(pid, [])) != 2]
    first = unit_rows([pair[0] for _, pair in twins])
    second = unit_rows([pair[1] for _, pair in twins])
    similarity = first @ second.T
    own = np.diag(similarity)
    nearest_stranger = np.where(np.eye(len(twins), dtype=bool), -np.inf, similarity).max(axis=1)
    misattributed = [
        prompts[pid].text
        for (pid, _), same, other in zip(twins, own, nearest_stranger, strict=True)
        if same < MIN_COSINE or other >= same or other >= MIN_COSINE
    ]

    # --- a sample against Transformers --------------------------------------------------------
    sample = rng.sample(twins, min(REFERENCE_SAMPLE, len(twins)))
    for pid, pair in sample:
        expected = expected_vector(reference, prompts[pid])
        assert_matches(pair[0].tolist(), expected)
        assert_matches(pair[1].tolist(), expected)

    proxy_metrics = httpx.get(stack.proxy_url + "/metrics", timeout=10).text
    misses = metric(proxy_metrics, "hidden_state_proxy_vector_misses_total")
    upstream_errors = metric(proxy_metrics, "hidden_state_proxy_upstream_errors_total")

    lines = [
        f"soak: {REQUESTS} requests ({len(prompts)} unique flagged prompts, each sent twice), "
        f"concurrency {CONCURRENCY}; warm-up {WARM_UP} in {warm_up_time:.1f} s, "
        f"then {len(rest)} in {run_time:.1f} s = {len(rest) / run_time:.1f} requests/s",
        f"{'kind':<26}{'count':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}",
    ]
    for kind in MIX:
        values = tally.latencies.get(kind, [])
        lines.append(
            f"{kind:<26}{len(values):>6}{percentile(values, 50) * 1e3:>9.1f}"
            f"{percentile(values, 99) * 1e3:>9.1f}{max(values, default=0) * 1e3:>9.1f}"
        )
    lines += [
        "statuses: " + ", ".join(f"{s}: {c}" for s, c in sorted(tally.statuses.items())),
        f"failures: {len(tally.failures)}; misattributed: {len(misattributed)}; twin cosine min "
        f"{own.min():.9f}; nearest other prompt's cosine max {nearest_stranger.max():.6f}",
        f"proxy vector misses {misses:g}, upstream errors {upstream_errors:g}",
        "proxy RSS MiB by requests sent: "
        + ", ".join(f"{n}: {m:.1f}" for n, m in rss_samples)
        + f"; growth after warm-up {(rss_at_end - rss_after_warm_up) / MIB:+.2f} MiB",
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))

    assert not tally.failures, f"{len(tally.failures)} failed: {tally.failures[:10]}"
    assert sum(tally.statuses.values()) == REQUESTS
    assert not missing, f"{len(missing)} prompts without both vectors"
    assert not misattributed, f"{len(misattributed)} misattributed, e.g. {misattributed[:5]}"
    assert misses == 0 and upstream_errors == 0
    assert rss_at_end - rss_after_warm_up < MAX_RSS_GROWTH, lines[-1]
