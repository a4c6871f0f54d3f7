"""The engine loop: prompts added as earlier results are read, vLLM's engine stepped, results
returned in input order (see the package docstring: *Any number of prompts*).

Each request gets a fresh request key and what to capture in a copy of its ``SamplingParams``
(``extra_args``: the proxy's ``vllm_xargs`` entries), ``output_kind`` ``FINAL_ONLY`` (as
``LLM.generate`` sets it), and, for the poolings of every prompt position, a fresh
``cache_salt`` (as the proxy sends: the prefix cache would skip cached positions). What its
records take of the ring is known before it is added, since its prompt is rendered first:
:class:`Budget` admits it only while the requests from the oldest not returned to the newest
fit the ring's slots and half of its arena.
"""

from __future__ import annotations

import copy
import secrets
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

from vllm_hidden_state_proxy.client import HiddenStateRequestError
from vllm_hidden_state_proxy.offline.engine_ring import engine_ring
from vllm_hidden_state_proxy.offline.records import states
from vllm_hidden_state_proxy.offline.types import (
    HiddenStateOutput,
    InFlight,
    OfflineHiddenStateError,
    described,
)
from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    ANSWER_WINDOW,
    ARENA_MIB_ENV,
    CHOICES_ENTRY,
    EVERY_PROMPT_POSITION,
    MATRIX_POOLINGS,
    MAX_RECORD_MIB_ENV,
    XARGS_PREFIX,
    new_request_key,
    request_key_to_wire,
)
from vllm_hidden_state_proxy.request_fields import RequestFieldError, VectorRequest
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.ring.layout import arena_block_size
from vllm_hidden_state_proxy.ring.records import matrix_bytes
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, resolve_layers, xargs_entries
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

#: One prompt of a call: (prompt, its SamplingParams, LoRA request, priority).
Item = tuple[Any, Any, Any, int]


class Budget:
    """What the requests from the oldest not returned to the newest added may publish: the
    ring's slots, and half its arena (see the module docstring)."""

    def __init__(self, reader: RingReader) -> None:
        shape = reader.shape
        self.slots = shape.slot_count
        self.arena = min(shape.arena_size, HookSettings().device_bytes) // 2
        self.max_record = shape.max_record
        self.records = 0
        self.bytes = 0

    def fits(self, item: InFlight, empty: bool) -> bool:
        if empty:
            return True
        return self.records + item.records <= self.slots and self.bytes + item.arena <= self.arena

    def add(self, item: InFlight, sign: int = 1) -> None:
        self.records += sign * item.records
        self.bytes += sign * item.arena


def _costs(
    wanted: WantedVectors, params: Any, num_prompt_tokens: int, hidden_size: int, llm: Any
) -> tuple[int, int, int]:
    """(records, arena bytes, one matrix's block) the hook publishes for one request."""
    request = wanted.request
    choices = int(getattr(params, "n", 1) or 1)
    pooling = request.record_pooling
    rows = 0
    if pooling == "all_prompt":
        rows = num_prompt_tokens
    elif request.spans is not None:
        rows = len(request.spans)
    elif pooling == "all_answer":
        max_tokens = params.max_tokens
        if max_tokens is None:  # vLLM's default: the rest of the context
            max_tokens = llm.llm_engine.vllm_config.model_config.max_model_len - num_prompt_tokens
        rows = max(int(max_tokens), 1)
    block = arena_block_size(matrix_bytes(rows, len(wanted.distinct_layers), hidden_size))
    if pooling == "last_answer":
        return choices * ANSWER_WINDOW, 0, 0
    if pooling == "all_answer":
        return choices, choices * block, block
    return 1, block if pooling in MATRIX_POOLINGS else 0, block


def run(
    llm: Any,
    items: Iterator[Item],
    render: Callable[[Any], Any],
    request: VectorRequest,
    use_tqdm: bool | Callable[..., Any],
    total: int | None,
) -> Generator[HiddenStateOutput, None, None]:
    """Checks what can be checked before any prompt is added (the ring, the layers), then the
    results, lazily."""
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError(
            "This LLM's engine has requests in flight from elsewhere (LLM.enqueue?): finish "
            "them first (LLM.wait_for_completion), or their outputs would be taken here."
        )
    reader = engine_ring(llm)
    shape = reader.shape
    try:
        wanted = resolve_layers(request, shape.num_hidden_layers, shape.layers, "layers")
        if request.record_pooling in MATRIX_POOLINGS and shape.arena_size == 0:
            raise OfflineHiddenStateError(
                f"This LLM's engine carries no matrices (pooling {request.record_pooling!r}): "
                f"its worker hook runs with {ARENA_MIB_ENV}=0. Create the LLM with an arena.",
                503,
            )
    except RequestFieldError as refused:
        reader.close()
        raise HiddenStateRequestError(refused.message, refused.param) from None
    except BaseException:
        reader.close()
        raise
    return _results(llm, reader, wanted, items, render, (use_tqdm, total))


def _results(
    llm: Any,
    reader: RingReader,
    wanted: WantedVectors,
    items: Iterator[Item],
    render: Callable[[Any], Any],
    bar: tuple[bool | Callable[..., Any], int | None],
) -> Generator[HiddenStateOutput, None, None]:
    engine = llm.llm_engine
    progress = Progress(*bar)
    budget = Budget(reader)
    window: deque[InFlight] = deque()  # added and not yet returned, in input order
    running: dict[str, tuple[InFlight, str]] = {}  # by request id: (it, vLLM's internal id)
    flush = in_process_flush(engine)
    ready: tuple[InFlight, Any, Any, Any, int] | None = None
    numbered = enumerate(items)
    try:
        while True:
            while True:  # add what fits
                if ready is None:
                    nxt = next(numbered, None)
                    if nxt is None:
                        break
                    ready = _prepared(llm, nxt[0], *nxt[1], render, wanted, budget, reader)
                item, engine_input, params, lora, priority = ready
                if not budget.fits(item, empty=not window):
                    break
                item.mark = reader.publish_count()
                internal = engine.add_request(
                    item.request_id, engine_input, params, lora_request=lora, priority=priority
                )
                window.append(item)
                running[item.request_id] = (item, internal)
                budget.add(item)
                ready = None
            if not window:
                return
            busy = engine.has_unfinished_requests()
            if not busy and window[0].output is None:
                raise OfflineHiddenStateError(
                    f"vLLM's engine stopped without an output for "
                    f"{described(window[0].index, window[0].prompt)}.",
                    502,
                    window[0].index,
                )
            if busy:
                for output in engine.step():
                    entry = running.get(output.request_id)
                    if entry is not None and output.finished:
                        entry[0].output = output
                        del running[output.request_id]
                        progress.update(output)
            while window and window[0].output is not None:
                found = states(reader, window[0], wanted, budget.slots, busy=busy, flush=flush)
                if found is None:
                    break  # the answer's records come with a coming step
                item = window.popleft()
                budget.add(item, -1)
                yield HiddenStateOutput(item.output, found)
    finally:
        if running:
            engine.abort_request([internal for _, internal in running.values()], internal=True)
        progress.close()
        reader.close()


def in_process_flush(engine: Any) -> Callable[[], None] | None:
    """For an engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one more step,
    which hands the finished requests to the runner, whose hook then publishes their answers'
    records. (An engine in its own process steps by itself; asking it would block.)"""
    try:
        from vllm.v1.engine.core_client import InprocClient
    except ImportError:
        return None
    if isinstance(engine.engine_core, InprocClient):
        return lambda: engine.step() and None
    return None


def _prepared(
    llm: Any,
    index: int,
    prompt: Any,
    params: Any,
    lora: Any,
    priority: int,
    render: Callable[[Any], Any],
    wanted: WantedVectors,
    budget: Budget,
    reader: RingReader,
) -> tuple[InFlight, Any, Any, Any, int]:
    """The prompt rendered, and its request: a fresh request key and what to capture in a copy
    of its SamplingParams (the proxy's ``vllm_xargs`` entries), its costs in the ring."""
    from vllm.sampling_params import RequestOutputKind

    engine_input = dict(render(prompt))
    token_ids = engine_input.get("prompt_token_ids")
    if not isinstance(token_ids, list):
        raise HiddenStateRequestError(
            f"{described(index, prompt)} has no token ids (prompt embeddings?): its hidden "
            "states cannot be checked against its length.",
            "prompts",
        )
    # A shallow copy: its own extra_args and output_kind, nothing of the caller's changed
    # (vLLM deep-copies it again as it takes the request: a second deep copy cost 15% here).
    params = copy.copy(params)
    extra = dict(params.extra_args or {})
    if any(str(name).startswith(XARGS_PREFIX) for name in extra):
        raise HiddenStateRequestError(
            f"SamplingParams.extra_args may not set entries named {XARGS_PREFIX}*: they are "
            "this module's own.",
            "sampling_params",
        )
    key = new_request_key()
    extra.update(xargs_entries(request_key_to_wire(key), wanted))
    if wanted.request.pooling in ANSWER_POOLINGS and params.n > 1:
        extra[CHOICES_ENTRY] = params.n
    params.extra_args = extra
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if wanted.request.record_pooling in EVERY_PROMPT_POSITION:
        engine_input["cache_salt"] = secrets.token_hex(16)  # every position must be computed
    records, arena, block = _costs(wanted, params, len(token_ids), reader.hidden_size, llm)
    if wanted.request.record_pooling in MATRIX_POOLINGS and block > budget.max_record:
        raise OfflineHiddenStateError(
            f"The matrix of {described(index, prompt)} takes {block / (1 << 20):.1f} MiB in "
            f"the arena, more than one request may ({MAX_RECORD_MIB_ENV}="
            f"{budget.max_record >> 20} in vLLM's environment): ask for fewer rows or layers.",
            413,
            index,
        )
    request_id = str(next(llm.request_counter))
    item = InFlight(index, prompt, request_id, key, len(token_ids), records, arena, 0)
    return item, engine_input, params, lora, priority


class Progress:
    """vLLM's progress bar of ``LLM.generate``: its description, counts and speeds."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int | None) -> None:
        self.bar: Any = None
        self.tokens = [0, 0]
        if use_tqdm:
            from tqdm.auto import tqdm

            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(
                total=total,
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix=f"est. speed input: {0:.2f} toks/s, output: {0:.2f} toks/s",
            )

    def update(self, output: Any) -> None:
        if self.bar is None:
            return
        self.tokens[0] += len(output.prompt_token_ids) * len(output.outputs)
        self.tokens[1] += sum(len(choice.token_ids) for choice in output.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.postfix = (
            f"est. speed input: {self.tokens[0] / elapsed:.2f} toks/s, "
            f"output: {self.tokens[1] / elapsed:.2f} toks/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
