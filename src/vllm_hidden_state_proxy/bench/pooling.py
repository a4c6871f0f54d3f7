"""The alternative users run today: a second vLLM server, ``--runner pooling --convert embed``
with LAST pooling and no normalisation, serving the same model. For the prompts whose vectors
the proxy returned earlier, ask it for an embedding of the same rendered chat prompt, compare
the two vectors (cosine; they should agree up to normalisation) and time its requests."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_hidden_state_proxy.bench.client import (
    EMBEDDINGS_PATH,
    BenchError,
    embeddings_body,
    new_client,
    timed_post,
)
from vllm_hidden_state_proxy.bench.progress import Progress
from vllm_hidden_state_proxy.bench.results import PoolingArm
from vllm_hidden_state_proxy.bench.stats import summarize

POOLING = "pooling"
DESCRIPTION = (
    "a second vLLM server (--runner pooling --convert embed, LAST pooling), /v1/embeddings"
)


def norm(vector: Sequence[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"vectors of different lengths ({len(a)} and {len(b)})")
    denominator = norm(a) * norm(b)
    if denominator == 0.0:
        raise ValueError("cosine of a zero vector")
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / denominator


def skipped(reason: str) -> PoolingArm:
    return PoolingArm(POOLING, DESCRIPTION, status="skipped", note=reason)


async def measure_pooling(
    url: str,
    model: str,
    ours: dict[int, list[float]],
    our_prompt_tokens: dict[int, int],
    requests: int,
    warmup: int,
    progress: Progress,
) -> PoolingArm:
    """Compare against ``ours`` (prompt index -> vector), then time ``requests`` requests."""
    if not ours:
        return skipped("no vectors from the flagged arm to compare with")
    indices = sorted(ours)
    cosines: list[float] = []
    norm_ratios: list[float] = []
    tokens_match = True
    latencies: list[float] = []
    async with new_client(url, 1) as client:
        for number in range(warmup):
            body = embeddings_body(model, indices[number % len(indices)])
            (await timed_post(client, EMBEDDINGS_PATH, body)).require_ok("pooling warm-up")
        task = progress.task("pooling server (same prompts, /v1/embeddings)", requests)
        for number in range(requests):
            index = indices[number % len(indices)]
            timed = await timed_post(client, EMBEDDINGS_PATH, embeddings_body(model, index))
            timed.require_ok("pooling request")
            latencies.append(timed.seconds)
            task.advance()
            if number >= len(indices):
                continue
            document = timed.json()
            theirs = document["data"][0]["embedding"]
            if not isinstance(theirs, list) or len(theirs) != len(ours[index]):
                raise BenchError(
                    f"pooling server: an embedding of {len(theirs)} values, "
                    f"expected {len(ours[index])}"
                )
            cosines.append(cosine(ours[index], theirs))
            norm_ratios.append(norm(ours[index]) / norm(theirs))
            prompt_tokens = document.get("usage", {}).get("prompt_tokens")
            if index in our_prompt_tokens and prompt_tokens != our_prompt_tokens[index]:
                tokens_match = False
        task.done()
    return PoolingArm(
        POOLING,
        DESCRIPTION,
        latency_ms=summarize(latencies, 1e3),
        prompts_compared=len(cosines),
        cosine_min=min(cosines),
        cosine_mean=math.fsum(cosines) / len(cosines),
        norm_ratio_mean=math.fsum(norm_ratios) / len(norm_ratios),
        prompt_tokens_match=tokens_match,
    )
