"""Reading answers: :func:`read_hidden_states` (a whole answer) and :class:`HiddenStateStream`
(a stream, chunk by chunk), both to a :class:`HiddenStateAnswer` of numpy float32 arrays."""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_hidden_state_proxy.client.types import (
    Array,
    Dtype,
    HiddenStateDecodeError,
    HiddenStateServerError,
)
from vllm_hidden_state_proxy.protocol import (
    BY_LAYER,
    DTYPE,
    DTYPES,
    FLAG,
    INFO,
    INFOS,
    KV,
    VECTOR,
    VECTORS,
)
from vllm_hidden_state_proxy.request_fields import is_int as _is_int

_ITEM_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _strict_base64(text: str) -> bytes:
    """Base64 that refuses any character outside the alphabet (a truncated or mangled string
    must not decode to other values); Python 3.11's strict mode is 2-4x faster than
    ``validate=True``, which runs a regular expression over the whole string first."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(text, strict_mode=True)
    return base64.b64decode(text, validate=True)


def decode_values(
    value: Any, dtype: str = "float32", where: str = VECTOR, *, stated: str | None = None
) -> Array:
    """One vector or matrix of the answer as float32: a base64 string (little-endian
    ``dtype``), a JSON list of numbers (``null``: not finite, read as NaN), or a matrix object
    ``{"shape", "dtype", "data"}``. ``where`` names the field in errors. ``stated``: the dtype
    the answer declares (or the reader was asked for), which a matrix's own ``dtype`` must not
    contradict."""
    if isinstance(value, Mapping):
        return _decode_matrix(value, where, stated)
    if isinstance(value, str):
        return _from_base64(value, dtype, where)
    if isinstance(value, (list, tuple)):
        return _from_list(value, where, rows=None)
    if isinstance(value, np.ndarray):
        return value.astype(np.float32)
    raise HiddenStateDecodeError(
        f"{where} is a {type(value).__name__}, not a base64 string, a list of numbers or a "
        "matrix object."
    )


def _from_base64(text: str, dtype: str, where: str) -> Array:
    if not isinstance(dtype, str) or dtype not in _ITEM_SIZE:
        raise HiddenStateDecodeError(f"{where}: unknown dtype {dtype!r} (one of {DTYPES}).")
    try:
        raw = _strict_base64(text)
    except (binascii.Error, ValueError) as exc:
        raise HiddenStateDecodeError(f"{where} is not valid base64 ({exc}).") from None
    return decode_bytes(raw, dtype, where)


def decode_bytes(raw: bytes | bytearray | memoryview, dtype: str, where: str = VECTOR) -> Array:
    """Little-endian ``dtype`` values (as the proxy's base64 carries them, or the offline API
    reads them) as a new float32 array."""
    if len(raw) % _ITEM_SIZE[dtype]:
        raise HiddenStateDecodeError(
            f"{where} holds {len(raw)} bytes, not a whole number of {dtype} values: was it "
            f"asked for as another dtype than {dtype!r}?"
        )
    if dtype == "float16":
        return np.frombuffer(raw, "<f2").astype(np.float32)
    if dtype == "bfloat16":  # float32's upper half
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").astype(np.float32)
    return np.frombuffer(raw, "<f4").astype(np.float32)


def _from_list(values: Sequence[Any], where: str, rows: int | None) -> Array:
    try:
        array = np.array(
            [[np.nan if v is None else v for v in row] for row in values]
            if rows is not None
            else [np.nan if v is None else v for v in values],
            dtype=np.float32,
        )
    # OverflowError: an integer of hundreds of digits; RecursionError: lists nested deep
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise HiddenStateDecodeError(f"{where} is not a list of numbers ({exc}).") from None
    if array.ndim != (1 if rows is None else 2):
        raise HiddenStateDecodeError(f"{where} is not a flat list of numbers.")
    return array


#: A matrix's rows and hidden size are each below this (token positions, the ring's sizes).
_MAX_DIMENSION = 1 << 31


def _decode_matrix(matrix: Mapping[str, Any], where: str, stated: str | None = None) -> Array:
    for name in ("shape", "dtype", "data"):
        if name not in matrix:
            raise HiddenStateDecodeError(f"{where} is a matrix object without its {name!r}.")
    shape = matrix["shape"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or not all(_is_int(n) and 0 <= n < _MAX_DIMENSION for n in shape)
    ):
        raise HiddenStateDecodeError(
            f"{where}: shape {shape!r} is not [rows, hidden_size] (each below 2**31)."
        )
    rows, width = shape
    data = matrix["data"]
    if isinstance(data, str):
        dtype = matrix["dtype"]
        if stated is not None and dtype != stated:
            raise HiddenStateDecodeError(
                f"{where} is a matrix of {dtype!r} values (its dtype), not the {stated} the "
                f"answer says ({KV}.{DTYPE}) or the reader was asked for."
            )
        flat = _from_base64(data, dtype, where)
    elif isinstance(data, (list, tuple)):
        if len(data) != rows:
            raise HiddenStateDecodeError(f"{where} has {len(data)} rows, not the shape's {rows}.")
        flat = _from_list(data, where, rows).reshape(-1) if rows else np.zeros(0, np.float32)
    else:
        raise HiddenStateDecodeError(f"{where}'s data is a {type(data).__name__}.")
    if flat.size != rows * width:
        raise HiddenStateDecodeError(
            f"{where} holds {flat.size} values, not {rows} x {width} (its shape)."
        )
    return flat.reshape(rows, width)


@dataclass(frozen=True, eq=False)
class HiddenStates:
    """One entry: one prompt's vectors (or matrices), or with an answer pooling one choice's.

    ``vector`` is the final layer's (``last_hidden_state``), when the final layer was asked
    for or no layers were given; ``by_layer`` maps each requested layer, as written in the
    request (``-1`` stays ``-1``), to its array; ``info`` is ``last_hidden_state_info``.

    Compared by identity: ``==`` never compares arrays (numpy's element-wise ``==`` has no
    truth value, and LangChain's merging of chunks compares what they carry).
    """

    vector: Array | None
    by_layer: Mapping[int, Array] = field(default_factory=dict)
    info: Mapping[str, Any] | None = None

    def layer(self, layer: int) -> Array:
        """Layer ``layer``'s array, as requested (``-1``: the final layer's)."""
        if layer in self.by_layer:
            return self.by_layer[layer]
        if layer == -1 and self.vector is not None:
            return self.vector
        raise KeyError(
            f"layer {layer} is not in this answer (it has {sorted(self.by_layer)}"
            f"{' and the final layer' if self.vector is not None else ''})"
        )


@dataclass(frozen=True)
class HiddenStateAnswer:
    """Every entry of one answer, in prompt order (a completions list of prompts) or choice
    order (``"last_answer"``/``"all_answer"`` with several choices); one entry otherwise."""

    entries: tuple[HiddenStates, ...]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> HiddenStates:
        return self.entries[index]

    @property
    def single(self) -> HiddenStates:
        """The one entry; ``ValueError`` if the answer has several (use ``entries``)."""
        if len(self.entries) != 1:
            raise ValueError(
                f"this answer has {len(self.entries)} entries (one per prompt or choice): "
                "index it, or read .entries"
            )
        return self.entries[0]

    @property
    def vector(self) -> Array | None:
        return self.single.vector

    @property
    def by_layer(self) -> Mapping[int, Array]:
        return self.single.by_layer

    @property
    def info(self) -> Mapping[str, Any] | None:
        return self.single.info


def as_document(answer: Any) -> dict[str, Any]:
    """A dict of ``answer``: an OpenAI SDK object (pydantic), an httpx (or requests) response,
    a JSON string or bytes, or a mapping."""
    if isinstance(answer, Mapping):
        return dict(answer)
    if isinstance(answer, (str, bytes, bytearray)):
        try:
            document = json.loads(answer)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise HiddenStateDecodeError(f"the answer is not JSON ({exc!r}).") from None
        return as_document(document)
    status = getattr(answer, "status_code", None)
    if _is_int(status) and callable(getattr(answer, "json", None)):  # httpx, requests
        try:
            document = answer.json()
        except (ValueError, RecursionError) as exc:
            if status == 200:
                raise HiddenStateDecodeError(f"the answer is not JSON ({exc!r}).") from None
            document = None
        if status != 200 or not isinstance(document, Mapping):
            message = error_message(document) or str(getattr(answer, "text", ""))[:500]
            raise HiddenStateServerError(message or "no body", status)
        return dict(document)
    dump = getattr(answer, "model_dump", None)
    if callable(dump):  # pydantic (the OpenAI SDK's objects keep unknown fields as extras)
        document = dump()
        if isinstance(document, Mapping):
            return dict(document)
    raise HiddenStateDecodeError(
        f"cannot read a {type(answer).__name__}: pass an OpenAI SDK object, a dict, JSON text "
        "or an httpx response."
    )


def server_error(document: Any) -> HiddenStateServerError | None:
    """The error a document is, if it is one: OpenAI's ``{"error": {"message", "code"}}``
    (the proxy's, vLLM's today) or vLLM's older ``{"object": "error", "message", "code"}``."""
    if not isinstance(document, Mapping):
        return None
    error = document.get("error")
    if isinstance(error, Mapping):
        found = error
    elif document.get("object") == "error":
        found = document
    else:
        return None
    code = found.get("code")
    return HiddenStateServerError(str(found.get("message")), code if _is_int(code) else None)


def error_message(document: Any) -> str | None:
    error = server_error(document)
    return None if error is None else error.message


def _params_of(document: Mapping[str, Any]) -> Mapping[str, Any]:
    error = server_error(document)
    if error is not None:
        raise error
    kv = document.get(KV)
    if kv is None and isinstance(document.get("response"), Mapping):  # a responses event
        kv = document["response"].get(KV)
    if not isinstance(kv, Mapping):
        raise HiddenStateDecodeError(
            f"the answer has no {KV} object: was the request flagged "
            f"({KV}.{FLAG}: true), and did it go through the proxy?"
        )
    return kv


def _declared_dtype(kv: Mapping[str, Any], dtype: str | None) -> str | None:
    """The dtype of the answer's base64 values: the one the answer declares (the proxy writes
    ``last_hidden_state_dtype`` beside 16-bit values; none means float32), or ``dtype`` for an
    answer from elsewhere; a ``dtype`` the answer contradicts is an error, never a silent
    misreading."""
    declared = kv.get(DTYPE)
    if declared is None:
        return dtype
    if not isinstance(declared, str) or declared not in _ITEM_SIZE:
        raise HiddenStateDecodeError(f"{KV}.{DTYPE} is {declared!r}, not one of {DTYPES}.")
    if dtype is not None and dtype != declared:
        raise HiddenStateDecodeError(
            f"the answer's values are {declared} ({KV}.{DTYPE}), not the {dtype} asked to read."
        )
    return str(declared)


def _info_dtype(info: Any) -> str | None:
    if isinstance(info, Mapping) and isinstance(info.get("dtype"), str):
        return str(info["dtype"])
    return None


#: A layer key as the proxy writes it (``str`` of the index as requested): ``"0"``, ``"-1"``;
#: never ``"-0"``, ``" 0"``, ``"00"``, ``"0_0"`` or other digits, which ``int()`` would all take.
_LAYER_KEY = re.compile(r"-?(?:0|[1-9][0-9]{0,8})")


def _layer_of(label: Any, where: str) -> int:
    if _is_int(label):
        return label
    if isinstance(label, str) and _LAYER_KEY.fullmatch(label) and label != "-0":
        return int(label)
    raise HiddenStateDecodeError(f"{where}{BY_LAYER} has the key {label!r}, not a layer index.")


def _entry(vector: Any, by_layer: Any, info: Any, dtype: str | None, where: str) -> HiddenStates:
    if info is not None and not isinstance(info, Mapping):
        raise HiddenStateDecodeError(f"{where}{INFO} is not an object.")
    stated = dtype if dtype is not None else _info_dtype(info)
    dtype = stated or "float32"
    decoded = (
        None if vector is None else decode_values(vector, dtype, f"{where}{VECTOR}", stated=stated)
    )
    layers: dict[int, Array] = {}
    if by_layer is not None:
        if not isinstance(by_layer, Mapping):
            raise HiddenStateDecodeError(f"{where}{BY_LAYER} is not an object.")
        for label, value in by_layer.items():
            layer = _layer_of(label, where)
            if layer in layers:
                raise HiddenStateDecodeError(f"{where}{BY_LAYER} has layer {layer} twice.")
            place = f"{where}{BY_LAYER}[{label!r}]"
            layers[layer] = decode_values(value, dtype, place, stated=stated)
    if decoded is None and not layers:
        raise HiddenStateDecodeError(f"{where}{KV} holds neither {VECTOR} nor {BY_LAYER}.")
    widths = {array.shape[-1] for array in (decoded, *layers.values()) if array is not None}
    hidden_size = info.get("hidden_size") if isinstance(info, Mapping) else None
    if len(widths) > 1 or (_is_int(hidden_size) and widths != {hidden_size}):
        raise HiddenStateDecodeError(
            f"{where}: the arrays have widths {sorted(widths)}"
            + (f", not the info's hidden_size {hidden_size}" if _is_int(hidden_size) else "")
            + f": was dtype {dtype!r} the one asked for?"
        )
    return HiddenStates(decoded, layers, info)


def is_per_entry(kv: Mapping[str, Any]) -> bool:
    """Whether ``kv`` holds the plural fields (one entry per prompt of a list, or per choice
    with an answer pooling and several choices) rather than one entry."""
    return VECTORS in kv or INFOS in kv or isinstance(kv.get(BY_LAYER), list)


def _entries(kv: Mapping[str, Any], dtype: str | None) -> tuple[HiddenStates, ...]:
    dtype = _declared_dtype(kv, dtype)
    if not is_per_entry(kv):
        if VECTOR not in kv and BY_LAYER not in kv:
            raise HiddenStateDecodeError(
                f"{KV} holds neither {VECTOR} nor {BY_LAYER} (it has {sorted(kv)})."
            )
        return (_entry(kv.get(VECTOR), kv.get(BY_LAYER), kv.get(INFO), dtype, ""),)
    lists: dict[str, Any] = {name: kv[name] for name in (VECTORS, BY_LAYER, INFOS) if name in kv}
    for name, value in lists.items():
        if not isinstance(value, list):
            raise HiddenStateDecodeError(f"{KV}.{name} is not a list (one entry per prompt).")
    lengths = {len(value) for value in lists.values()}
    if len(lengths) != 1:
        raise HiddenStateDecodeError(
            f"{KV}'s lists differ in length: "
            + ", ".join(f"{name} {len(value)}" for name, value in lists.items())
        )
    [count] = lengths
    return tuple(
        _entry(
            lists[VECTORS][i] if VECTORS in lists else None,
            lists[BY_LAYER][i] if BY_LAYER in lists else None,
            lists[INFOS][i] if INFOS in lists else None,
            dtype,
            f"[{i}] ",
        )
        for i in range(count)
    )


def read_hidden_states(answer: Any, *, dtype: Dtype | None = None) -> HiddenStateAnswer:
    """The hidden states of one answer (chat, completions, responses; a JSON answer, or a
    stream's final object such as ``stream.get_final_completion()`` / ``get_final_response()``).

    ``dtype``: of base64 values, for an answer that does not say it; the proxy's answers do
    (``last_hidden_state_dtype`` beside 16-bit values, and the info's ``dtype``), and one that
    contradicts ``dtype`` raises :class:`HiddenStateDecodeError`.
    """
    return HiddenStateAnswer(_entries(_params_of(as_document(answer)), dtype))


def _event_payload(event: str) -> str | None:
    """An SSE event's data (its ``data:`` lines joined), ``None`` for an event without
    (a comment, a lone ``event:`` line); text of no SSE field is taken as the data itself
    (an SSE library's ``event.data``)."""
    lines = [line for line in event.split("\n") if line]
    data = [line[len("data:") :].strip() for line in lines if line.startswith("data:")]
    if data:
        return "\n".join(data)
    if all(line.startswith(("event:", "id:", "retry:", ":")) for line in lines):
        return None
    return event.strip()


#: The most characters one event of a stream's text may hold, by default: any answer of a proxy
#: at its defaults (256 MiB of float32 vectors, ``--max-vectors-size``, are 342 MiB of base64).
DEFAULT_MAX_EVENT_SIZE = 512 * 1024 * 1024


class HiddenStateStream:
    """Fed a flagged stream's chunks (chat, completions: SDK objects or dicts, or the SSE
    text as it arrives) or events (responses), one by one; :meth:`result` gives what
    :func:`read_hidden_states` gives for the same request unstreamed.

    Text (``str`` or ``bytes``) is read as the stream's text: a piece may hold several events,
    or end anywhere inside one (httpx's ``iter_text()``/``iter_bytes()``; with ``iter_lines()``,
    feed each ``line + "\n"``: the line ends are the stream's). Events end at a blank line;
    the rest waits for the next piece, except a ``data:`` line that already holds whole JSON,
    which is read at once (so one event, or one ``data:`` line, per call works too; an event
    fed in pieces without its blank line is read by :meth:`result` at the latest).

    The work is linear in the text fed: each piece is looked at once, and an event that is not
    yet whole is tried as JSON again only once it has doubled. An event longer than
    ``max_event_size`` characters raises :class:`HiddenStateDecodeError` (nothing holds more
    of it than that).

    The vectors ride on the first chunk with a choice (prompt poolings), on each choice's
    last chunk (answer poolings, one entry per choice, in choice order), or on
    ``response.completed`` (responses). An error event raises :class:`HiddenStateServerError`.
    """

    def __init__(
        self, *, dtype: Dtype | None = None, max_event_size: int = DEFAULT_MAX_EVENT_SIZE
    ) -> None:
        if not (_is_int(max_event_size) and max_event_size > 0):
            raise ValueError(f"max_event_size must be a positive integer, not {max_event_size!r}")
        self._dtype: Dtype | None = dtype
        self._max_event_size = max_event_size
        self._by_choice: dict[int, HiddenStates] = {}
        self._pending: list[str] = []  # the pieces of an event not yet complete
        self._pending_size = 0
        self._tried_at = 0  # the pending size when it last failed to read as whole JSON
        self._held_cr = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")()  # a character cut between bytes

    def feed(self, chunk: Any) -> HiddenStates | None:
        """Read one chunk or event, or a piece of the stream's text; the entry it carried
        (the last one, if the text held several), if any."""
        if isinstance(chunk, (bytes, bytearray)):
            try:
                chunk = self._utf8.decode(bytes(chunk))
            except UnicodeDecodeError as exc:
                raise HiddenStateDecodeError(f"the stream's bytes are not UTF-8 ({exc}).") from None
        if isinstance(chunk, str):
            return self._feed_text(chunk)
        return self._read(as_document(chunk))

    def _hold(self, piece: str) -> None:
        self._pending.append(piece)
        self._pending_size += len(piece)
        if self._pending_size > self._max_event_size:
            raise HiddenStateDecodeError(
                f"an event of the stream is longer than max_event_size ({self._max_event_size} "
                "characters): raise it for larger answers, or is the stream not SSE?"
            )

    def _take_pending(self) -> str:
        event = "".join(self._pending)
        self._pending, self._pending_size, self._tried_at = [], 0, 0
        return event

    def _feed_text(self, text: str) -> HiddenStates | None:
        # Each piece is looked at once (a matrix's event can be many MiB in small pieces): the
        # event so far is kept as a list of pieces, joined only when it ends, and the text is
        # walked by position (slicing off each event would copy the rest each time).
        text = self._held_cr + text
        self._held_cr = "\r" if text.endswith("\r") else ""  # maybe half of a "\r\n"
        text = text[: len(text) - len(self._held_cr)].replace("\r\n", "\n").replace("\r", "\n")
        found = None
        start = 0
        while start < len(text):
            if self._pending and self._pending[-1].endswith("\n") and text.startswith("\n", start):
                end, rest = start, start + 1  # the blank line begun at the end of the last piece
            else:
                end = text.find("\n\n", start)
                rest = end + 2
            if end < 0:
                break
            self._hold(text[start:end])
            _, entry = self._read_event(self._take_pending(), ended=True)
            found = entry or found
            start = rest
        if start < len(text):
            piece = text[start:]
            self._hold(piece)
            # Maybe a whole data line already: tried when it ends like one, and again only once
            # the event has doubled since it last failed, so that the tries add up to at most
            # twice the event (a piece of a long event ends in "}" now and then).
            ends_like_json = piece.rstrip("\n").endswith(("}", "[DONE]"))
            if ends_like_json and self._pending_size >= 2 * self._tried_at:
                read, entry = self._read_event("".join(self._pending), ended=False)
                if read:
                    self._take_pending()
                    found = entry or found
                else:
                    self._tried_at = self._pending_size
        return found

    def _read_event(self, event: str, *, ended: bool) -> tuple[bool, HiddenStates | None]:
        """Whether ``event`` was read, and the entry it carried. An event not ``ended`` (by a
        blank line) is read only if its data is already a whole JSON object."""
        payload = _event_payload(event)
        if payload is None or payload == "[DONE]":
            return True, None
        if ended:
            return True, self._read(as_document(payload))
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError):
            return False, None  # the rest comes with the next piece
        if not isinstance(document, dict):  # (a cut number could parse, a cut object not)
            return False, None
        return True, self._read(document)

    def _read(self, document: Mapping[str, Any]) -> HiddenStates | None:
        error = server_error(document)
        if error is not None:
            raise error
        if document.get("type") == "error":  # the Responses API's error event
            code = document.get("code")
            raise HiddenStateServerError(
                str(document.get("message")), code if _is_int(code) else None
            )
        kv = document.get(KV)
        response = document.get("response")
        if kv is None and isinstance(response, Mapping):
            kv = response.get(KV)
        if not isinstance(kv, Mapping) or not (VECTOR in kv or BY_LAYER in kv):
            return None
        choices = document.get("choices")
        index = 0
        if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
            found = choices[0].get("index", 0)
            if not (_is_int(found) and found >= 0):
                raise HiddenStateDecodeError(
                    f"choices[0].index is {found!r}, not a choice's index."
                )
            index = found
        if index in self._by_choice:
            raise HiddenStateDecodeError(f"choice {index}'s vectors came twice in the stream.")
        entry = _entries(kv, self._dtype)
        if len(entry) != 1:
            raise HiddenStateDecodeError("a stream chunk carried a list of entries.")
        self._by_choice[index] = entry[0]
        return entry[0]

    def feed_all(self, chunks: Iterable[Any]) -> HiddenStateAnswer:
        """:meth:`feed` each of ``chunks`` (passing nothing on), then :meth:`result`."""
        for chunk in chunks:
            self.feed(chunk)
        return self.result()

    def result(self) -> HiddenStateAnswer:
        """Every entry the stream carried, in choice order; ``HiddenStateDecodeError`` if none,
        or if the text fed ended inside an event."""
        if self._pending:  # an event fed without its blank line is whole, or was cut
            event = "".join(self._pending)
            read, _ = self._read_event(event, ended=False)
            if not read:
                raise HiddenStateDecodeError(
                    f"the stream's text ended inside an event ({event[:60]!r}...): was all of "
                    "it fed?"
                )
            self._take_pending()
        if not self._by_choice:
            raise HiddenStateDecodeError(
                f"no chunk of the stream carried {KV} with vectors: was the request flagged, "
                "and was the whole stream fed?"
            )
        return HiddenStateAnswer(tuple(self._by_choice[i] for i in sorted(self._by_choice)))
