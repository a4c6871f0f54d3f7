"""The client module against hostile answers and streams (issue #50): whatever an answer, a
stream or a capture description holds, the reader raises only its documented errors
(``HiddenStateDecodeError``, ``HiddenStateServerError``) naming the field; the stream reader's
work is linear in what it is fed, and one event is bounded (``max_event_size``). What held up
before stays: shapes that claim more than their data are refused before any allocation, NaN and
Inf are kept."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest

from vllm_hidden_state_proxy.client import (
    HiddenStateDecodeError,
    HiddenStateServerError,
    HiddenStateStream,
    read_capture,
    read_hidden_states,
)
from vllm_hidden_state_proxy.client import answers as answers_module

HIDDEN = 4
MIB = 1 << 20


def b64(values: Any, dtype: str = "<f4") -> str:
    return base64.b64encode(np.asarray(values, dtype).tobytes()).decode()


def kv(**fields: Any) -> str:
    """An answer's JSON text with these ``kv_transfer_params``."""
    return json.dumps({"kv_transfer_params": fields})


def matrix(shape: list[int], data: Any, dtype: str = "float32") -> dict[str, Any]:
    return {"shape": shape, "dtype": dtype, "data": data}


#: (answer JSON text, the field the error must name)
HOSTILE: list[tuple[str, str]] = [
    # a 401-digit integer in a float list (numpy: OverflowError)
    ('{"kv_transfer_params": {"last_hidden_state": [' + "9" * 401 + "]}}", "last_hidden_state"),
    (kv(last_hidden_state=b64([1.0] * HIDDEN), last_hidden_state_dtype=[]),
     "last_hidden_state_dtype"),
    (kv(last_hidden_state=b64([1.0] * HIDDEN), last_hidden_state_dtype={"a": 1}),
     "last_hidden_state_dtype"),
    # JSON nested 10^5 deep (json: RecursionError)
    ('{"kv_transfer_params": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON"),
    # a matrix of 0 rows and 2**70 columns (numpy's reshape: a bare ValueError)
    (kv(last_hidden_state=matrix([0, 2**70], "")), "shape"),
    (kv(last_hidden_state=matrix([2**70, 0], [])), "shape"),
    # a matrix's own dtype contradicting the answer's
    (kv(last_hidden_state=matrix([1, 2], b64([1.0, 2.0])), last_hidden_state_dtype="float16"),
     "dtype"),
    # layer keys that are not the canonical index (all read as 0 before, the last winning)
    (kv(last_hidden_states_by_layer={"0": b64([1.0]), "-0": b64([2.0])}), "'-0'"),
    (kv(last_hidden_states_by_layer={" 0": b64([1.0])}), "' 0'"),
    (kv(last_hidden_states_by_layer={"0_0": b64([1.0])}), "'0_0'"),
    (kv(last_hidden_states_by_layer={"00": b64([1.0])}), "'00'"),
    (kv(last_hidden_states_by_layer={"+1": b64([1.0])}), "'+1'"),
    # a shape whose dimensions are not integers, or nested lists of the wrong depth
    (kv(last_hidden_state={"shape": [1.5, 2], "dtype": "float32", "data": [[1.0, 2.0]]}), "shape"),
    (kv(last_hidden_state=[[1.0], [2.0]]), "last_hidden_state"),
    # plural lists that are not lists of the right kind
    (kv(last_hidden_states="x"), "last_hidden_states"),
    (kv(last_hidden_states=[b64([1.0])], last_hidden_state_infos=[7]), "last_hidden_state_info"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "field"), HOSTILE, ids=[f"{f}-{i}" for i, (_, f) in
                                                            enumerate(HOSTILE)])  # fmt: skip
def test_a_hostile_answer_is_a_decode_error_naming_the_field(text: str, field: str) -> None:
    for answer in (text, text.encode(), httpx.Response(200, content=text.encode())):
        with pytest.raises(HiddenStateDecodeError) as raised:
            read_hidden_states(answer)
        assert field in str(raised.value), str(raised.value)


def test_a_matrix_of_another_dtype_than_asked_to_read_is_an_error() -> None:
    """The docs say a contradiction is an error: a matrix's own dtype is no exception."""
    answer = kv(last_hidden_state=matrix([1, 2], b64([1.0, 2.0])))
    assert read_hidden_states(answer).vector.shape == (1, 2)  # type: ignore[union-attr]
    with pytest.raises(HiddenStateDecodeError, match=r"float32.*float16"):
        read_hidden_states(answer, dtype="float16")
    sixteen = kv(last_hidden_state=matrix([1, 2], b64([1.0, 2.0], "<f2"), "float16"),
                 last_hidden_state_dtype="float16")  # fmt: skip
    np.testing.assert_array_equal(read_hidden_states(sixteen).vector, [[1.0, 2.0]])  # type: ignore[arg-type]


def test_layer_keys_read_as_written_and_a_layer_once() -> None:
    answer = kv(last_hidden_states_by_layer={"0": b64([1.0]), "-1": b64([2.0]), "12": b64([3.0])})
    assert sorted(read_hidden_states(answer).by_layer) == [-1, 0, 12]
    with pytest.raises(HiddenStateDecodeError, match="layer 0 twice"):
        read_hidden_states({"kv_transfer_params": {"last_hidden_states_by_layer": {
            "0": b64([1.0]), 0: b64([2.0])}}})  # fmt: skip


def test_vllms_error_object_is_a_server_error() -> None:
    """vLLM's own error shape, ``{"object": "error", ...}``, in a body or a stream."""
    error = {"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}
    with pytest.raises(HiddenStateServerError) as raised:
        read_hidden_states(error)
    assert (raised.value.status, raised.value.message) == (400, "boom")
    with pytest.raises(HiddenStateServerError, match="boom"):
        HiddenStateStream().feed("data: " + json.dumps(error) + "\n\n")
    with pytest.raises(HiddenStateServerError, match="boom"):
        read_capture(error)


@pytest.mark.parametrize("index", ["1", 1.0, -1, True, None])
def test_a_stream_chunk_of_no_choice_index_is_an_error(index: Any) -> None:
    chunk = {"choices": [{"index": index}], "kv_transfer_params": {
        "last_hidden_state": b64([1.0] * HIDDEN)}}  # fmt: skip
    with pytest.raises(HiddenStateDecodeError, match=r"choices\[0\]\.index"):
        HiddenStateStream().feed(chunk)


def test_bytes_that_are_not_utf8_are_a_decode_error() -> None:
    reader = HiddenStateStream()
    with pytest.raises(HiddenStateDecodeError, match="UTF-8"):
        reader.feed(b'data: {"a": "\xff"}\n\n')


CAPTURE: dict[str, Any] = {
    "object": "hidden_state_capture", "model": "m", "models": ["m"], "hidden_size": 8,
    "num_hidden_layers": 2, "layers": [0, 2], "poolings": ["last"], "formats": ["base64"],
    "dtypes": ["float32"], "limits": {"max_prompts": 1, "max_body_bytes": 1024},
    "engines": [{"instance": "a", "engine": 0, "runner": "x", "hidden_size": 8,
                 "num_hidden_layers": 2, "layers": [0, 2], "slots": 4, "arena_bytes": 0,
                 "max_record_bytes": 0}],
}  # fmt: skip


def capture_text(path: tuple[Any, ...], value: str) -> str:
    """:data:`CAPTURE` as JSON with the field at ``path`` replaced by the raw JSON ``value``."""
    document = json.loads(json.dumps(CAPTURE))
    target = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = "@@"
    return json.dumps(document).replace('"@@"', value)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("hidden_size",), "1e400", "hidden_size"),
        (("hidden_size",), "1.5", "hidden_size"),
        (("hidden_size",), "true", "hidden_size"),
        (("hidden_size",), "0", "hidden_size"),
        (("num_hidden_layers",), "-1", "num_hidden_layers"),
        (("layers",), '"0,1"', "layers"),
        (("layers",), "[1e400]", "layers"),
        (("limits",), "[]", "limits"),
        (("limits", "max_prompts"), "1e400", "limits.max_prompts"),
        (("engines", 0, "slots"), "1.5", "engines[0].slots"),
        (("engines", 0, "slots"), str(2**70), "engines[0].slots"),
        (("engines",), '"x"', "engines"),
        (("model",), "[1]", "model"),
        (("poolings",), "7", "poolings"),
    ],
)
def test_a_hostile_capture_description_is_a_decode_error_naming_the_field(
    path: tuple[Any, ...], value: str, field: str
) -> None:
    assert read_capture(json.dumps(CAPTURE)).hidden_size == 8
    with pytest.raises(HiddenStateDecodeError) as raised:
        read_capture(capture_text(path, value))
    assert field in str(raised.value), str(raised.value)


# -- the stream reader's work and bound --------------------------------------------------------


class _Work:
    """The characters every read attempt of an event looks at (each goes through
    ``_event_payload``); fails as soon as they pass ``limit``, so a quadratic reader fails
    fast instead of running for minutes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
        self.characters = 0
        self.calls = 0
        original = answers_module._event_payload

        def counted(event: str) -> str | None:
            self.characters += len(event)
            self.calls += 1
            assert self.characters <= limit, f"{self.characters} characters read, over {limit}"
            return original(event)

        monkeypatch.setattr(answers_module, "_event_payload", counted)


def big_event(size: int) -> tuple[str, np.ndarray[Any, Any]]:
    """One SSE event of about ``size`` characters with a vector: its chat text is ``}``s, so
    any cut inside it ends in ``}``."""
    vector = np.arange(HIDDEN, dtype=np.float32)
    head = {"choices": [{"index": 0, "delta": {"content": "@@"}}],
            "kv_transfer_params": {"last_hidden_state": b64(vector)}}  # fmt: skip
    text = "data: " + json.dumps(head) + "\n\n"
    return text.replace("@@", "}" * (size - len(text))), vector


def test_a_32_mib_event_in_64_kib_pieces_ending_in_a_brace_is_read_in_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each piece ends in ``}``: the reader may try to read the event early (one data line per
    call works), but no more than a few times its size in all (it was 256 times: 48 s)."""
    size, piece = 32 * MIB, 64 * 1024
    text, vector = big_event(size)
    work = _Work(monkeypatch, limit=4 * len(text))
    reader = HiddenStateStream()
    for start in range(0, len(text), piece):
        chunk = text[start : start + piece]
        assert chunk.endswith("}") or start + piece >= len(text)
        reader.feed(chunk.encode())
    np.testing.assert_array_equal(reader.result().vector, vector)  # type: ignore[arg-type]
    assert work.calls <= 2 * (size // piece).bit_length() + 2


def test_many_events_in_one_piece_are_read_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    vector = np.arange(HIDDEN, dtype=np.float32)
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    text = ("data: " + json.dumps(chunk) + "\n\n") * 20_000
    last = {"choices": [{"index": 0}], "kv_transfer_params": {"last_hidden_state": b64(vector)}}
    text += "data: " + json.dumps(last) + "\n\ndata: [DONE]\n\n"
    _Work(monkeypatch, limit=2 * len(text))
    reader = HiddenStateStream()
    reader.feed(text)
    np.testing.assert_array_equal(reader.result().vector, vector)  # type: ignore[arg-type]


def test_an_event_over_the_bound_is_a_decode_error() -> None:
    """An event that never ends is not kept whole: past ``max_event_size`` characters, the
    documented error (the default holds any answer of a proxy at its defaults)."""
    default = getattr(answers_module, "DEFAULT_MAX_EVENT_SIZE", 0)
    assert default >= 342 * MIB  # 256 MiB of float32 (--max-vectors-size) in base64
    reader = HiddenStateStream(max_event_size=MIB)
    reader.feed('data: {"choices": [')
    with pytest.raises(HiddenStateDecodeError, match="max_event_size"):
        for _ in range(64):
            reader.feed("0, " * 10_000)
    whole, _ = big_event(2 * MIB)
    with pytest.raises(HiddenStateDecodeError, match="max_event_size"):
        HiddenStateStream(max_event_size=MIB).feed(whole)
    with pytest.raises(ValueError, match="max_event_size"):
        HiddenStateStream(max_event_size=0)


def test_an_event_fed_whole_without_its_blank_line_is_read_at_once_or_at_the_end() -> None:
    vector = np.arange(HIDDEN, dtype=np.float32)
    event = {"choices": [{"index": 0, "delta": {"content": "a } in the text"}}],
             "kv_transfer_params": {"last_hidden_state": b64(vector)}}  # fmt: skip
    text = "data: " + json.dumps(event)
    reader = HiddenStateStream()
    assert reader.feed(text) is not None  # one data line per call
    reader = HiddenStateStream()
    cut = text.index("} in")
    reader.feed(text[: cut + 1])  # ends in "}": not yet whole
    reader.feed(text[cut + 1 :])
    np.testing.assert_array_equal(reader.result().vector, vector)  # type: ignore[arg-type]


# -- what held up ------------------------------------------------------------------------------


HELD: list[tuple[Any, str]] = [
    (kv(last_hidden_state=matrix([10**9, HIDDEN], [[1.0] * HIDDEN])), "1 rows, not the shape's"),
    (kv(last_hidden_state=matrix([10**9, HIDDEN], b64([1.0] * HIDDEN))), "not 1000000000 x 4"),
    (kv(last_hidden_state=matrix([1, 2], b64([1.0] * 4))), "not 1 x 2"),
    (kv(last_hidden_state=matrix([2, 2], [[1.0, 2.0], [3.0]])), "not a list of numbers"),
    (kv(last_hidden_state="AAAAAAA="), "not a whole number"),
    (kv(last_hidden_state="AAAAAA\u00e9="), "not valid base64"),
    (kv(last_hidden_state=b64([1.0]), last_hidden_state_dtype="float8"), "float8"),
    (kv(last_hidden_state=matrix([1, 1], "AAAA", "float8")), "unknown dtype"),
]


@pytest.mark.parametrize(("text", "fragment"), HELD, ids=[f for _, f in HELD])
def test_what_held_up_still_does(text: str, fragment: str) -> None:
    with pytest.raises(HiddenStateDecodeError, match=fragment):
        read_hidden_states(text)


def test_nan_and_inf_are_kept() -> None:
    values = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    vector = read_hidden_states(kv(last_hidden_state=b64(values))).vector
    assert vector is not None
    assert np.isnan(vector[0]) and list(vector[1:]) == [np.inf, -np.inf, 1.0]
    for dtype in ("float16", "bfloat16"):
        raw = values.astype("<f2") if dtype == "float16" else (values.view("<u4") >> 16).astype(
            "<u2")  # fmt: skip
        text = kv(last_hidden_state=base64.b64encode(raw.tobytes()).decode(),
                  last_hidden_state_dtype=dtype)  # fmt: skip
        read = read_hidden_states(text).vector
        assert read is not None and np.isnan(read[0]) and list(read[1:]) == [np.inf, -np.inf, 1.0]
