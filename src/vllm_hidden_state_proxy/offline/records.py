"""A request's records, read from its engine's ring once vLLM's output for it is final, checked
against the request, and given as the client module's :class:`HiddenStates`.

A prompt's record (pooling ``"last"``, ``"mean"``, ``"all_prompt"``, spans) is published when
its prompt is computed, before its output is final; an answer's (``"last_answer"``,
``"all_answer"``), one per choice, the engine step after the choice ends. A record not there
yet while the engine has work is looked up again after its next step; otherwise it is waited
for (:data:`RECORD_TIMEOUT`). The ring reader proves the record is the request key's (key
echo, seqlock, CRC); :func:`_checked` that it is what the request asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_hidden_state_proxy.client import HiddenStateAnswer, HiddenStates
from vllm_hidden_state_proxy.client.answers import decode_bytes
from vllm_hidden_state_proxy.offline.types import InFlight, OfflineHiddenStateError, described
from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    MATRIX_POOLINGS,
    all_answer_key,
    answer_key,
)
from vllm_hidden_state_proxy.ring import ErrorRecord, PendingRows, Record, RingReader
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors, as_dtype, vector_info

#: How long a record may take to appear once vLLM's output for its request is final and the
#: engine has nothing left to do (an answer's records come the step after it ends).
RECORD_TIMEOUT = 30.0
_FIRST_BACKOFF = 50e-6
_MAX_BACKOFF = 5e-3


def states(
    reader: RingReader,
    item: InFlight,
    wanted: WantedVectors,
    slots: int,
    *,
    busy: bool,
    flush: Callable[[], None] | None,
) -> HiddenStateAnswer | None:
    """``item``'s hidden states, checked; ``None`` if they are not published yet and the
    engine is ``busy`` (its next step may publish them: an answer's come the step after it
    ends); else waits for them (``flush``: see :func:`.engine_loop.in_process_flush`)."""
    output, pooling = item.output, wanted.request.pooling
    if pooling in ANSWER_POOLINGS:
        counts = [(choice.index, len(choice.token_ids)) for choice in output.outputs]
        for choice, count in counts:
            if count < 1:
                raise OfflineHiddenStateError(
                    f"Choice {choice} of {described(item.index, item.prompt)} generated no "
                    "token (max_tokens 0?), so there is no answer state to return: ask for "
                    "at least one token.",
                    400,
                    item.index,
                )
        keys = [
            all_answer_key(item.key, index)
            if pooling == "all_answer"
            else answer_key(item.key, index, count)
            for index, count in counts
        ]
    else:
        counts, keys = [(0, 0)], [item.key]
    last = _find(reader, keys[-1], item.key)  # an answer's: published last, if at all
    if busy and last is None:
        return None
    entries = []
    for at, ((choice, count), key) in enumerate(zip(counts, keys, strict=True)):
        found = last if at == len(keys) - 1 else _find(reader, key, item.key)
        found = found or _wait(reader, key, item, slots, flush)
        entries.append(_entry(_checked(found, item, wanted, choice, count), wanted))
    return HiddenStateAnswer(tuple(entries))


def _find(reader: RingReader, key: bytes, request_key: bytes) -> Record | ErrorRecord | None:
    """The record under ``key``, or the hook's error record under the request key."""
    found = reader.find(key)
    if found is None and key != request_key:
        found = reader.find(request_key)
        if not isinstance(found, ErrorRecord):
            found = None
    return found.load() if isinstance(found, PendingRows) else found


def _wait(
    reader: RingReader,
    key: bytes,
    item: InFlight,
    slots: int,
    flush: Callable[[], None] | None,
) -> Record | ErrorRecord:
    deadline, delay = time.monotonic() + RECORD_TIMEOUT, _FIRST_BACKOFF
    if flush is not None:
        flush()
    while True:
        found = _find(reader, key, item.key)
        if found is not None:
            return found
        if reader.publish_count() - item.mark >= slots:
            raise OfflineHiddenStateError(
                f"The hidden state of {described(item.index, item.prompt)} was written over "
                f"in the ring ({slots} slots) before it was read, which the offline "
                "reading should prevent: please report it.",
                504,
                item.index,
            )
        if time.monotonic() >= deadline:
            raise OfflineHiddenStateError(
                f"The hidden state of {described(item.index, item.prompt)} did not arrive "
                f"within {RECORD_TIMEOUT:g} s of vLLM's output: the worker hook did not "
                "publish it.",
                504,
                item.index,
            )
        time.sleep(delay)
        delay = min(delay * 2, _MAX_BACKOFF)


def _checked(
    found: Record | ErrorRecord, item: InFlight, wanted: WantedVectors, choice: int, count: int
) -> Record:
    """The record, if it is what ``item`` asked for (the ring reader checked its key): its
    layers and pooling, the prompt's length vLLM's output reports, the position (and rows)
    that length and the choice's token count name. Else the error, naming the prompt."""
    where = described(item.index, item.prompt)
    if isinstance(found, ErrorRecord):
        raise OfflineHiddenStateError(
            f"The vLLM worker hook could not produce the hidden state of {where}: {found.message}",
            found.status,
            item.index,
        )
    record, request = found, wanted.request
    pooling, layers = request.record_pooling, wanted.distinct_layers
    if record.pooling != pooling or not set(layers) <= set(record.layers):
        raise OfflineHiddenStateError(
            f"The worker hook published layers {list(record.layers)} ({record.pooling}) for "
            f"{where}, which asked for layers {list(layers)} ({pooling}): the hook in vLLM "
            "and this module come from different releases of vllm-hidden-state-proxy.",
            502,
            item.index,
        )
    prompt_length = len(item.output.prompt_token_ids)
    position, rows = {
        "last": (prompt_length - 1, 1),
        "mean": (prompt_length - 1, 1),
        "all_prompt": (0, prompt_length),
        "spans": (0, len(request.spans or ())),
        "last_answer": (prompt_length + count - 2, 1),
        "all_answer": (prompt_length - 1, count),
    }[pooling]
    matrix_rows = record.rows if pooling != "all_answer" else min(record.rows, count)
    if (
        record.num_prompt_tokens != prompt_length
        or prompt_length != item.num_prompt_tokens
        or record.position != position
        or matrix_rows != rows
    ):
        raise OfflineHiddenStateError(
            f"The worker hook's record for {where} is of position {record.position} "
            f"({record.rows} rows) of a {record.num_prompt_tokens}-token prompt, but vLLM's "
            f"output has a {prompt_length}-token prompt"
            + (f" and {count} tokens in choice {choice}" if pooling in ANSWER_POOLINGS else "")
            + f" (position {position}, {rows} rows): please report it.",
            502,
            item.index,
        )
    return record.first_rows(count) if pooling == "all_answer" else record


def _entry(record: Record, wanted: WantedVectors) -> HiddenStates:
    """A record as the client module's :class:`HiddenStates`, as the proxy and the client
    together would give it (16-bit dtypes rounded, then widened)."""
    dtype, shape = wanted.request.dtype, (record.rows, record.hidden_size)
    matrix = record.pooling in MATRIX_POOLINGS

    def array(layer: int) -> Any:
        values = decode_bytes(as_dtype(record.vector(layer), dtype), dtype)
        return values.reshape(shape) if matrix else values

    vector = array(wanted.final_layer) if wanted.final_layer in wanted.layers else None
    by_layer = {}
    if wanted.request.layers is not None:
        by_layer = {
            label: array(layer)
            for label, layer in zip(wanted.request.layers, wanted.layers, strict=True)
        }
    return HiddenStates(vector, by_layer, vector_info(record, wanted))
