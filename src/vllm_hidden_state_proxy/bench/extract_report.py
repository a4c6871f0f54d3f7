"""The extract comparison's report (:mod:`.extract_compare` measures): its three tables and
``extract-throughput.png``."""

from __future__ import annotations

from vllm_hidden_state_proxy.bench.extract_compare import (
    EXTRACT,
    MAX_RELATIVE_L2,
    MEMORY_TITLE,
    MIN_COSINE,
    PARTS_TITLE,
    POOLING_MANY,
    POOLING_ONE,
    POOLINGS,
    TITLE,
    TRANSFORMERS,
    Measured,
    Tally,
    agreement,
)
from vllm_hidden_state_proxy.bench.report import Row, Table


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def transformers_rate(measured: Measured) -> tuple[int, float] | None:
    """(the fastest batch size, its vectors/s); one forward pass gives both poolings."""
    found = measured.transformers
    if not found:
        return None
    best = int(found["best_batch_size"])
    return best, float(found["batch_sizes"][str(best)]["rate"])


def pooling_server_memory(measured: Measured) -> float | None:
    seen = [measured.memory.get(f"pooling {p}") for p in POOLINGS]
    found = [value for value in seen if value is not None]
    return max(found) if found else None


def compare_tables(measured: Measured) -> dict[str, Table]:
    """The three tables of the comparison."""
    inputs, tallies = measured.inputs, measured.tallies
    loop = transformers_rate(measured)
    loop_rate = None if loop is None else loop[1]
    generation_memory = measured.memory.get("generation")
    pooling_memory = pooling_server_memory(measured)

    def rate(name: str, pooling: str) -> float | None:
        tally = tallies.get(f"{name}|{pooling}")
        return None if tally is None else tally.rate(inputs)

    rows: list[Row] = []
    for pooling in POOLINGS:
        pooling_rate = rate(POOLING_ONE, pooling)
        reference = measured.reference.get(f"reference_{pooling}", {})
        for name, memory in (
            (EXTRACT, generation_memory),
            (POOLING_ONE, pooling_memory),
            (POOLING_MANY, pooling_memory),
        ):
            tally = tallies.get(f"{name}|{pooling}")
            if tally is None:
                continue
            found = tally.rate(inputs)
            rows.append(
                {
                    "method": name,
                    "pooling": pooling,
                    "vectors/s": found,
                    "range over rounds": tally.spread(inputs),
                    "/ pooling server (1 a request)": _ratio(found, pooling_rate),
                    "/ Transformers": _ratio(found, loop_rate),
                    "peak RSS MiB": memory,
                    "equals Transformers": agreement(tally.vectors, reference).cell(),
                }
            )
        if loop is not None:
            best = measured.reference.get(f"best_{pooling}", {})
            rows.append(
                {
                    "method": f"{TRANSFORMERS} (batch {loop[0]})",
                    "pooling": pooling,
                    "vectors/s": loop_rate,
                    "/ pooling server (1 a request)": _ratio(loop_rate, pooling_rate),
                    "/ Transformers": 1.0,
                    "peak RSS MiB": measured.transformers.get("peak_rss_mib"),
                    "equals Transformers": agreement(best, reference).cell()
                    + " (its batch against batch 1)",
                }
            )
    sizes = ", ".join(
        f"{size}: {entry['rate']:.0f}/s"
        for size, entry in (measured.transformers.get("batch_sizes") or {}).items()
    )
    note = (
        f"{inputs} token-id prompts ({measured.tokens} tokens, no chat template), final layer, "
        f"{measured.concurrency} requests in flight in every arm (extract's default here: its "
        f"proxy's ring slots; the batched pooling arm: as many inputs in flight). vectors/s: "
        f"the median over rounds of one whole corpus' rate (extract: the whole library call, "
        f"dataset written). Transformers: one forward pass gives both poolings (by batch size: "
        f"{sizes}); its vectors at batch 1, unpadded, are the reference every row is compared "
        f"with by id (cosine >= {MIN_COSINE}, relative L2 <= {MAX_RELATIVE_L2:g}). Peak RSS: "
        "the process tree (serve: the proxy and vLLM; the pooling server: its vLLM; the "
        "loop: its python process), sampled every 0.1 s."
    )
    parts: list[Row] = []
    pooling_last = rate(POOLING_ONE, "last")
    for name, what in (
        ("vLLM direct, unflagged", "one-token generation alone"),
        ("proxy, unflagged", "+ the proxy's hop"),
        ("proxy, flagged (bare client)", "+ capture, ring, vectors in the answer"),
        (EXTRACT, "+ extract's client: decoding, the dataset"),
        (POOLING_ONE, "vLLM's pooling runner instead"),
    ):
        found = rate(name, "last")
        parts.append(
            {
                "arm": name,
                "adds": what,
                "vectors/s": found,
                "range over rounds": tallies.get(f"{name}|last", Tally()).spread(inputs),
                "/ pooling server": _ratio(found, pooling_last),
            }
        )
    memories: list[Row] = [
        {"what": "one generation server (serve: proxy + vLLM)", "peak RSS MiB": generation_memory},
        {"what": "the pooling server alone", "peak RSS MiB": pooling_memory},
        {
            "what": "generation server + pooling server",
            "peak RSS MiB": None
            if generation_memory is None or pooling_memory is None
            else generation_memory + pooling_memory,
        },
        {
            "what": "the Transformers loop",
            "peak RSS MiB": measured.transformers.get("peak_rss_mib"),
        },
    ]
    return {
        "extract_compare": Table(TITLE, rows, note),
        "extract_parts": Table(
            PARTS_TITLE,
            parts,
            "The same inputs and concurrency, the arms taking turns on one generation server; "
            "each row adds one part of extract's path to the row above.",
        ),
        "extract_memory": Table(
            MEMORY_TITLE,
            memories,
            "RSS of the process trees (shared pages counted in each process); a user running a "
            "pooling server for vectors runs it beside the generation server.",
        ),
    }
