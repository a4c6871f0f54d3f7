"""An answer's rows: decoded by the client module and checked whole against the plan before
any is written (one row per entry: the input's, or one per choice with an answer pooling). An
answer that cannot make them is a :class:`~vllm_hidden_state_proxy.extract.exchange.Refused`:
that input's failure (a line of the errors file, the reason starting ``the answer``), never the
run's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def answer_rows(id_: str, body: bytes, plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of a 200 answer's ``body`` for input ``id_`` (see the module docstring)."""
    try:
        entries = read_hidden_states(body, dtype=plan["dtype"]).entries
    except (HiddenStateDecodeError, HiddenStateServerError) as exc:
        raise Refused(f"the answer: {exc}", 200) from None
    wanted = plan["n"] if plan["pooling"] in ANSWER_POOLINGS else 1
    if len(entries) != wanted:  # one row short would be an id --resume skips
        raise Refused(f"the answer held {len(entries)} entries, not {wanted}", 200)
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
