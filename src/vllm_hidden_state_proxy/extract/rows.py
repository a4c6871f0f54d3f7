"""An answer's rows: decoded by the client module and checked whole against the plan before
any is written (one row per entry: the input's, or one per choice with an answer pooling). An
answer that cannot make them is a :class:`~vllm_hidden_state_proxy.extract.exchange.Refused`:
that input's failure (a line of the errors file, the reason starting ``the answer``), never the
run's.

The answer to a batch (:func:`batch_rows`) must hold, for its ``k`` inputs, exactly one choice
per prompt index and choice (``choices[].index`` ``0 .. k * n - 1``, each once) and one entry
per input (per choice with an answer pooling), each with its vectors, taken in prompt order
(the proxy answers a list so); an entry for a token-id prompt must say that prompt's length in
its info's ``num_prompt_tokens`` (the lists are matched by position: a length that differs is
an entry of another prompt). Otherwise the whole answer is refused (the run splits the batch
and sends the halves again)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from vllm_hidden_state_proxy.client import (
    HiddenStateDecodeError,
    HiddenStateServerError,
    read_hidden_states,
)
from vllm_hidden_state_proxy.extract.dataset import column_name
from vllm_hidden_state_proxy.extract.exchange import Refused
from vllm_hidden_state_proxy.protocol import ANSWER_POOLINGS
from vllm_hidden_state_proxy.request_fields import is_int

#: The answer info's integers that become columns (beside ``id`` and ``choice``): int32.
INFO_COLUMNS = ("position", "num_prompt_tokens", "num_output_tokens")
_INT32 = range(-(1 << 31), 1 << 31)


def _document(body: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # nested too deep included
        raise Refused(f"the answer: the answer is not JSON ({exc})", 200) from None
    if not isinstance(document, dict):
        raise Refused("the answer: the answer is not a JSON object", 200)
    return document


def _entries(document: Mapping[str, Any], plan: Mapping[str, Any], wanted: int) -> Sequence[Any]:
    try:
        entries = read_hidden_states(document, dtype=plan["dtype"]).entries
    except (HiddenStateDecodeError, HiddenStateServerError) as exc:
        raise Refused(f"the answer: {exc}", 200) from None
    if len(entries) != wanted:  # one row short would be an id --resume skips
        raise Refused(f"the answer held {len(entries)} entries, not {wanted}", 200)
    return entries


def _per_input(plan: Mapping[str, Any]) -> int:
    return plan["n"] if plan["pooling"] in ANSWER_POOLINGS else 1


def answer_rows(id_: str, body: bytes, plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of a 200 answer's ``body`` for input ``id_`` (see the module docstring)."""
    return _rows(id_, _entries(_document(body), plan, _per_input(plan)), plan)


def batch_rows(
    ids: Sequence[str],
    body: bytes,
    plan: Mapping[str, Any],
    prompt_tokens: Sequence[int | None] | None = None,
) -> list[list[dict[str, Any]]]:
    """The rows of each input of a batch from its 200 answer's ``body`` (see the module
    docstring), in the batch's order. ``prompt_tokens``: each input's count of prompt tokens
    where it is known (a token-id prompt), which its entries' info must say."""
    document = _document(body)
    choices = document.get("choices")
    expected = len(ids) * plan["n"]
    if not isinstance(choices, list) or len(choices) != expected:
        held = len(choices) if isinstance(choices, list) else "no list of"
        raise Refused(f"the answer held {held} choices, not {expected}", 200)
    indices = sorted(
        int(c["index"]) if isinstance(c, dict) and is_int(c.get("index")) else -1 for c in choices
    )
    if indices != list(range(expected)):
        raise Refused(f"the answer's choices are not indexed 0 to {expected - 1}, each once", 200)
    per_input = _per_input(plan)
    entries = _entries(document, plan, len(ids) * per_input)
    by_input = [entries[i * per_input : (i + 1) * per_input] for i in range(len(ids))]
    for number, tokens in enumerate(prompt_tokens or ()):
        for entry in by_input[number] if tokens is not None else ():
            said = (entry.info or {}).get("num_prompt_tokens")
            if said is not None and said != tokens:  # another input's entry, or none's
                raise Refused(
                    f"the answer's entry {number * per_input} says {said!r} prompt tokens, "
                    f"not the {tokens} of prompt {number}",
                    200,
                )
    return [_rows(id_, entries, plan) for id_, entries in zip(ids, by_input, strict=True)]


def _rows(id_: str, entries: Sequence[Any], plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    expected = 2 if plan["matrix"] else 1
    for choice, entry in enumerate(entries):
        info = entry.info or {}
        row: dict[str, Any] = {"id": id_, "choice": choice}
        for name in INFO_COLUMNS:
            value = info.get(name)
            if value is not None and not (is_int(value) and value in _INT32):
                raise Refused(
                    f"the answer's info has {name} {value!r}, not an integer of 32 bits", 200
                )
            row[name] = value
        for layer in plan["layers"]:
            try:
                array = entry.layer(layer)
            except KeyError:
                reason = f"the answer lacked layer {layer} (it has {sorted(entry.by_layer)})"
                raise Refused(reason, 200) from None
            if array.ndim != expected or array.shape[-1] != plan["hidden_size"]:
                want = ("rows", plan["hidden_size"]) if plan["matrix"] else (plan["hidden_size"],)
                shape = str(want).replace("'", "")
                raise Refused(
                    f"the answer's layer {layer} has shape {array.shape}, not {shape}", 200
                )
            row[column_name(layer)] = array
        rows.append(row)
    return rows
