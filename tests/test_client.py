"""client.py: the request fields (checked as the proxy checks them), decoding every shape of
answer into numpy (against the proxy's own encoders), the stream reader, the edge cases that
must fail clearly, and that it imports with numpy alone. Real answers: tests/e2e/test_client.py.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from vllm_hidden_state_proxy.client import (
    HiddenStateDecodeError,
    HiddenStateRequestError,
    HiddenStateServerError,
    HiddenStateStream,
    decode_values,
    hidden_state_fields,
    read_hidden_states,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.inspection import Flagged, inspect_body
from vllm_hidden_state_proxy.proxy.vectors.encoding import dump_json, encode_matrix, encode_vector

RNG = np.random.default_rng(7)
HIDDEN = 6


def values(*shape: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    return RNG.standard_normal(shape).astype(np.float32)


def wire(array: np.ndarray[Any, Any], fmt: str = "base64", dtype: str = "float32") -> Any:
    """``array`` as the proxy writes it (its own encoders), then through JSON."""
    raw = array.astype("<f4").tobytes()
    if array.ndim == 2:
        encoded: Any = encode_matrix(raw, array.shape[0], array.shape[1], fmt, dtype)
    else:
        encoded = encode_vector(raw, fmt, dtype)
    return json.loads(dump_json(encoded))


def rounded(array: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """What a 16-bit answer holds: the proxy's rounding, decoded independently."""
    raw = base64.b64decode(wire(array.reshape(-1), "base64", dtype))
    if dtype == "float16":
        return np.frombuffer(raw, "<f2").astype(np.float32).reshape(array.shape)
    if dtype == "bfloat16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(array.shape)
    return array


# -- request fields ----------------------------------------------------------------------------


def test_the_default_fields_ask_for_the_final_layer_in_base64() -> None:
    assert hidden_state_fields() == {
        "kv_transfer_params": {
            "return_last_hidden_state": True,
            "last_hidden_state_pooling": "last",
            "last_hidden_state_format": "base64",
        }
    }


def test_fields_keep_vllms_own_entries_and_spans_default_to_mean() -> None:
    kv = hidden_state_fields(
        spans=[(0, 2), [1, 3]], info=True, kv_transfer_params={"do_remote_prefill": False}
    )["kv_transfer_params"]
    assert kv["last_hidden_state_pooling"] == "mean"
    assert kv["last_hidden_state_spans"] == [[0, 2], [1, 3]]
    assert kv["do_remote_prefill"] is False and kv["last_hidden_state_info"] is True


def test_layers_are_deduplicated_in_order() -> None:
    kv = hidden_state_fields(layers=[4, -1, 4, 0])["kv_transfer_params"]
    assert kv["last_hidden_state_layers"] == [4, -1, 0]


BAD_FIELDS: list[dict[str, Any]] = [
    {"pooling": "max"},
    {"format": "hex"},
    {"dtype": "float64"},
    {"dtype": "float16", "format": "float"},
    {"layers": []},
    {"layers": [True]},
    {"layers": [1.5]},
    {"layers": list(range(1025))},
    {"spans": []},
    {"spans": [[2, 2]]},
    {"spans": [[-1, 2]]},
    {"spans": [[0, 1, 2]]},
    {"spans": [[0, (1 << 31) + 1]]},
    {"spans": [[0, 1]] * 1025},
    {"spans": [[0, 1]], "pooling": "last"},
    {"info": 1},
]
GOOD_FIELDS: list[dict[str, Any]] = [
    {},
    {"pooling": "all_answer", "dtype": "bfloat16"},
    {"pooling": "all_prompt", "format": "float"},
    {"spans": [[0, 1 << 31]] * 1024},
    {"layers": list(range(1024)), "info": True},
]


@pytest.mark.parametrize("arguments", BAD_FIELDS, ids=[str(a)[:40] for a in BAD_FIELDS])
def test_what_the_proxy_refuses_the_client_refuses_naming_the_same_field(
    arguments: dict[str, Any],
) -> None:
    with pytest.raises(HiddenStateRequestError) as raised:
        hidden_state_fields(**arguments)
    # the proxy's own inspection, on the same fields as the client would have written them
    kv: dict[str, Any] = {"return_last_hidden_state": True}
    names = {"pooling": "pooling", "format": "format", "dtype": "dtype", "layers": "layers",
             "spans": "spans", "info": "info"}  # fmt: skip
    for name, value in arguments.items():
        kv[f"last_hidden_state_{names[name]}"] = value
    if "spans" in arguments and "pooling" not in arguments:
        kv["last_hidden_state_pooling"] = "mean"
    body = json.dumps({"messages": [], "kv_transfer_params": kv}).encode()
    with pytest.raises(ProxyError) as refused:
        inspect_body(body)
    assert refused.value.status == 400
    assert refused.value.param == raised.value.param


@pytest.mark.parametrize("arguments", GOOD_FIELDS, ids=[str(a)[:40] for a in GOOD_FIELDS])
def test_what_the_client_builds_the_proxy_accepts(arguments: dict[str, Any]) -> None:
    body = {"messages": [], **hidden_state_fields(**arguments)}
    assert isinstance(inspect_body(json.dumps(body).encode()), Flagged)


# -- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_vectors_and_matrices_decode_in_every_dtype(dtype: str) -> None:
    vector, matrix = values(HIDDEN), values(3, HIDDEN)
    answer = {
        "choices": [],
        "kv_transfer_params": {
            "last_hidden_state": wire(vector, dtype=dtype),
            "last_hidden_states_by_layer": {"0": wire(matrix, dtype=dtype)},
            "last_hidden_state_info": {"dtype": dtype, "hidden_size": HIDDEN},
        },
    }
    states = read_hidden_states(answer)
    assert states.vector is not None and states.vector.dtype == np.float32
    np.testing.assert_array_equal(states.vector, rounded(vector, dtype))
    np.testing.assert_array_equal(states.by_layer[0], rounded(matrix, dtype))
    assert states.single.layer(-1) is states.vector


def test_float_lists_are_exact_and_null_is_nan() -> None:
    vector, matrix = values(HIDDEN), values(2, HIDDEN)
    floats = wire(vector, "float")
    floats[1] = None
    answer = {
        "kv_transfer_params": {
            "last_hidden_state": floats,
            "last_hidden_states_by_layer": {"-1": wire(matrix, "float")},
        }
    }
    states = read_hidden_states(answer)
    assert states.vector is not None and np.isnan(states.vector[1])
    np.testing.assert_array_equal(np.delete(states.vector, 1), np.delete(vector, 1))
    np.testing.assert_array_equal(states.single.layer(-1), matrix)  # by_layer's -1 first


def test_plurals_are_one_entry_each_in_order() -> None:
    vectors = [values(HIDDEN) for _ in range(3)]
    answer = {
        "kv_transfer_params": {
            "last_hidden_states": [wire(v) for v in vectors],
            "last_hidden_states_by_layer": [{"1": wire(v * 2)} for v in vectors],
            "last_hidden_state_infos": [{"position": i} for i in range(3)],
        }
    }
    states = read_hidden_states(answer)
    assert len(states) == 3
    for i, entry in enumerate(states.entries):
        np.testing.assert_array_equal(entry.vector, vectors[i])  # type: ignore[arg-type]
        np.testing.assert_array_equal(entry.by_layer[1], vectors[i] * 2)
        assert entry.info == {"position": i}
    with pytest.raises(ValueError, match="3 entries"):
        states.vector  # noqa: B018


def test_openai_sdk_objects_and_httpx_responses_are_read() -> None:
    from openai.types.chat import ChatCompletion

    vector = values(HIDDEN)
    document = {
        "id": "x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant",
                                                                       "content": "a"}}],
        "kv_transfer_params": {"last_hidden_state": wire(vector)},
    }  # fmt: skip
    sdk = ChatCompletion.model_validate(document)
    np.testing.assert_array_equal(read_hidden_states(sdk).vector, vector)  # type: ignore[arg-type]
    response = httpx.Response(200, json=document)
    np.testing.assert_array_equal(read_hidden_states(response).vector, vector)  # type: ignore[arg-type]
    np.testing.assert_array_equal(read_hidden_states(json.dumps(document)).vector, vector)  # type: ignore[arg-type]


BROKEN: list[tuple[Any, str]] = [
    ({"choices": []}, "no kv_transfer_params"),
    ({"kv_transfer_params": {"other": 1}}, "neither last_hidden_state nor"),
    ({"kv_transfer_params": {"last_hidden_state": "not base64!"}}, "not valid base64"),
    ({"kv_transfer_params": {"last_hidden_state": "AAAAAAA="}}, "not a whole number of float32"),
    ({"kv_transfer_params": {"last_hidden_state": 3}}, "is a int"),
    ({"kv_transfer_params": {"last_hidden_state": ["a"]}}, "not a list of numbers"),
    ({"kv_transfer_params": {"last_hidden_state": {"shape": [2, 3], "dtype": "float32"}}},
     "without its 'data'"),
    ({"kv_transfer_params": {"last_hidden_state": {"shape": [2, 3], "dtype": "float32",
                                                   "data": "AAAAAA=="}}}, "not 2 x 3"),
    ({"kv_transfer_params": {"last_hidden_state": {"shape": [2], "dtype": "float32",
                                                   "data": ""}}}, "is not [rows, hidden_size]"),
    ({"kv_transfer_params": {"last_hidden_state": {"shape": [2, 1], "dtype": "float32",
                                                   "data": [[1.0]]}}}, "1 rows, not the shape's 2"),
    ({"kv_transfer_params": {"last_hidden_state": {"shape": [1, 1], "dtype": "float8",
                                                   "data": "AAAA"}}}, "unknown dtype"),
    ({"kv_transfer_params": {"last_hidden_states_by_layer": {"x": "AAAAAA=="}}}, "not a layer"),
    ({"kv_transfer_params": {"last_hidden_states": ["AAAAAA=="],
                             "last_hidden_state_infos": [{}, {}]}}, "differ in length"),
    ({"kv_transfer_params": {"last_hidden_state": "AAAAAA==",
                             "last_hidden_state_info": {"hidden_size": 2}}}, "hidden_size 2"),
    ({"kv_transfer_params": {"last_hidden_state": "AAAAAA==",
                             "last_hidden_states_by_layer": {"0": "AAAAAAAAAAA="}}}, "widths"),
]  # fmt: skip


@pytest.mark.parametrize(("answer", "fragment"), BROKEN, ids=[f for _, f in BROKEN])
def test_a_malformed_answer_is_a_clear_decode_error(answer: Any, fragment: str) -> None:
    with pytest.raises(HiddenStateDecodeError, match=fragment.replace("[", r"\[")):
        read_hidden_states(answer)


def test_a_16_bit_vector_read_as_float32_is_caught_by_its_info() -> None:
    vector = values(HIDDEN)
    info = {"hidden_size": HIDDEN}
    answer = {
        "kv_transfer_params": {
            "last_hidden_state": wire(vector, dtype="float16"),
            "last_hidden_state_info": info,
        }
    }
    with pytest.raises(HiddenStateDecodeError, match="dtype 'float32'"):
        read_hidden_states(answer)
    np.testing.assert_array_equal(
        read_hidden_states(answer, dtype="float16").vector,  # type: ignore[arg-type]
        rounded(vector, "float16"),
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_answer_says_its_dtype_and_reads_right_without_info(dtype: str) -> None:
    """The proxy writes last_hidden_state_dtype beside 16-bit values: read without its info
    or a dtype= (e.g. LangChain's per-call extra_body), it is typed, never float32 of half
    the length; a dtype= it contradicts is an error."""
    vector, matrix = values(HIDDEN), values(2, HIDDEN)
    answer = {
        "kv_transfer_params": {
            "last_hidden_state": wire(vector, dtype=dtype),
            "last_hidden_states_by_layer": {"3": wire(matrix, dtype=dtype)},
            "last_hidden_state_dtype": dtype,
        }
    }
    states = read_hidden_states(answer)
    np.testing.assert_array_equal(states.vector, rounded(vector, dtype))  # type: ignore[arg-type]
    np.testing.assert_array_equal(states.by_layer[3], rounded(matrix, dtype))
    np.testing.assert_array_equal(
        read_hidden_states(answer, dtype=dtype).vector,  # type: ignore[arg-type]
        rounded(vector, dtype),
    )
    with pytest.raises(HiddenStateDecodeError, match=f"values are {dtype} .*not the float32"):
        read_hidden_states(answer, dtype="float32")
    stream = HiddenStateStream()
    stream.feed({"choices": [{"index": 0}], **answer})
    np.testing.assert_array_equal(stream.result().vector, rounded(vector, dtype))  # type: ignore[arg-type]
    with pytest.raises(HiddenStateDecodeError, match="is 'float8', not one of"):
        unknown = {**answer["kv_transfer_params"], "last_hidden_state_dtype": "float8"}
        read_hidden_states({"kv_transfer_params": unknown})


def test_error_answers_raise_with_the_servers_message_and_status() -> None:
    body = {"error": {"message": "Layer 7 is not captured", "code": 400, "param": "x"}}
    with pytest.raises(HiddenStateServerError) as raised:
        read_hidden_states(httpx.Response(400, json=body))
    assert (raised.value.status, raised.value.message) == (400, "Layer 7 is not captured")
    with pytest.raises(HiddenStateServerError, match="400: Layer 7"):
        read_hidden_states(body)
    with pytest.raises(HiddenStateServerError, match="502: bad gateway"):
        read_hidden_states(httpx.Response(502, text="bad gateway"))
    with pytest.raises(HiddenStateDecodeError, match="cannot read a object"):
        read_hidden_states(object())


def test_decode_values_names_where() -> None:
    with pytest.raises(HiddenStateDecodeError, match=r"^here is not valid base64"):
        decode_values("@@", where="here")


# -- streams -----------------------------------------------------------------------------------


def test_a_chat_stream_gives_per_choice_entries_in_choice_order() -> None:
    first, second = values(HIDDEN), values(HIDDEN)
    chunks: list[Any] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 1, "delta": {"content": "a"}, "finish_reason": "stop"}],
         "kv_transfer_params": {"last_hidden_state": wire(second)}},
        'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], '
        f'"kv_transfer_params": {{"last_hidden_state": "{wire(first)}"}}}}\n\n',
        "data: [DONE]",
    ]  # fmt: skip
    reader = HiddenStateStream()
    carried = [reader.feed(chunk) is not None for chunk in chunks]
    assert carried == [False, True, True, False]
    result = reader.result()
    np.testing.assert_array_equal(result[0].vector, first)  # type: ignore[arg-type]
    np.testing.assert_array_equal(result[1].vector, second)  # type: ignore[arg-type]


def test_openai_sdk_chunks_are_read() -> None:
    from openai.types.chat import ChatCompletionChunk

    vector = values(HIDDEN)
    chunk = ChatCompletionChunk.model_validate({
        "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant"}}],
        "kv_transfer_params": {"last_hidden_state": wire(vector)},
    })  # fmt: skip
    result = HiddenStateStream().feed_all([chunk])
    np.testing.assert_array_equal(result.vector, vector)  # type: ignore[arg-type]


def test_a_responses_stream_has_them_on_completed_only() -> None:
    vector = values(HIDDEN)
    events = [
        {"type": "response.created", "response": {"kv_transfer_params": None}},
        "event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\"}",
        "event: response.completed\ndata: " + json.dumps(
            {"type": "response.completed",
             "response": {"kv_transfer_params": {"last_hidden_state": wire(vector)}}}
        ),
    ]  # fmt: skip
    result = HiddenStateStream().feed_all(events)
    np.testing.assert_array_equal(result.vector, vector)  # type: ignore[arg-type]


def test_stream_errors_are_clear() -> None:
    with pytest.raises(HiddenStateDecodeError, match="no chunk of the stream"):
        HiddenStateStream().feed_all([{"choices": [{"index": 0}]}])
    with pytest.raises(HiddenStateServerError, match="hook failed"):
        HiddenStateStream().feed('data: {"error": {"message": "hook failed", "code": 502}}')
    twice = {"choices": [{"index": 0}], "kv_transfer_params": {"last_hidden_state": "AAAAAA=="}}
    reader = HiddenStateStream()
    reader.feed(twice)
    with pytest.raises(HiddenStateDecodeError, match="came twice"):
        reader.feed(twice)


def _sse(document: dict[str, Any], event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(document)}\n\n"


def _two_choice_stream() -> tuple[str, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A chat stream's SSE text, n=2, "last_answer": each choice's vector on its last chunk."""
    first, second = values(HIDDEN), values(HIDDEN)
    text = "".join([
        _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "é"}}]}),
        _sse({"choices": [{"index": 1, "delta": {"role": "assistant"}}]}),
        ": a comment\n\n",
        _sse({"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}],
              "kv_transfer_params": {"last_hidden_state": wire(second)}}),
        _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
              "kv_transfer_params": {"last_hidden_state": wire(first)}}),
        "data: [DONE]\n\n",
    ])  # fmt: skip
    return text, first, second


def _assert_two_choices(reader: HiddenStateStream, first: Any, second: Any) -> None:
    result = reader.result()
    assert len(result) == 2
    np.testing.assert_array_equal(result[0].vector, first)  # type: ignore[arg-type]
    np.testing.assert_array_equal(result[1].vector, second)  # type: ignore[arg-type]


def test_text_with_several_events_is_read_event_by_event() -> None:
    """httpx's iter_text() can give several events in one piece: each is read."""
    text, first, second = _two_choice_stream()
    reader = HiddenStateStream()
    found = reader.feed(text)  # the whole stream at once
    assert found is not None
    np.testing.assert_array_equal(found.vector, first)  # type: ignore[arg-type]  # the last one
    _assert_two_choices(reader, first, second)


@pytest.mark.parametrize("step", [1, 7, 64, 1000])
def test_text_cut_anywhere_is_buffered_until_its_events_are_whole(step: int) -> None:
    """Pieces of any size, cut inside a line, a "\r\n" or a UTF-8 character (bytes)."""
    text, first, second = _two_choice_stream()
    for as_bytes in (False, True):
        for crlf in (False, True):
            whole = text.replace("\n", "\r\n") if crlf else text
            stream: Any = whole.encode() if as_bytes else whole
            reader = HiddenStateStream()
            for start in range(0, len(stream), step):
                reader.feed(stream[start : start + step])
            _assert_two_choices(reader, first, second)


def test_lines_one_by_one_and_responses_events_are_read() -> None:
    """httpx's iter_lines(), each fed with its line end back (a data line is read as soon as
    its JSON is whole), and a responses stream's "event:" lines."""
    text, first, second = _two_choice_stream()
    reader = HiddenStateStream()
    for line in text.splitlines():
        reader.feed(line + "\n")
    _assert_two_choices(reader, first, second)
    vector = values(HIDDEN)
    kv = {"last_hidden_state": wire(vector)}
    completed = {"type": "response.completed", "response": {"kv_transfer_params": kv}}
    events = _sse({"type": "response.created"}, "response.created") + _sse(
        completed, "response.completed"
    )
    reader = HiddenStateStream()
    reader.feed(events[:-30])
    reader.feed(events[-30:])
    np.testing.assert_array_equal(reader.result().vector, vector)  # type: ignore[arg-type]


def test_text_that_ends_inside_an_event_is_an_error() -> None:
    text, _, _ = _two_choice_stream()
    reader = HiddenStateStream()
    cut = text.index("finish_reason")  # inside the first choice's last chunk
    reader.feed(text[:cut])
    with pytest.raises(HiddenStateDecodeError, match="ended inside an event"):
        reader.result()
    with pytest.raises(HiddenStateDecodeError, match="not JSON"):
        HiddenStateStream().feed("data: {not json\n\n")


# -- a client-only install ---------------------------------------------------------------------

SERVER_STACK = ("starlette", "uvicorn", "httpx", "aiohttp", "msgpack", "orjson", "multipart",
                "pydantic", "pybase64", "ml_dtypes", "torch", "vllm", "transformers",
                "openai")  # fmt: skip


def test_the_client_imports_with_numpy_alone() -> None:
    """With every server module made unimportable, the client still imports and works."""
    src = Path(__file__).resolve().parents[1] / "src"
    script = f"""
import sys
BLOCKED = {SERVER_STACK!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: a client-only install has no server stack")
        return None
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(src)!r})
before = set(sys.modules)
from vllm_hidden_state_proxy.client import hidden_state_fields, read_hidden_states
fields = hidden_state_fields(layers=[-1])
states = read_hidden_states({{"kv_transfer_params": {{"last_hidden_state": "AACAPw=="}}}})
assert states.vector.tolist() == [1.0], states
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
assert not loaded, loaded
# the imports brought nothing outside the standard library but numpy (and this package)
others = {{m.split(".")[0] for m in set(sys.modules) - before}} - set(sys.stdlib_module_names)
assert others == {{"numpy", "vllm_hidden_state_proxy"}}, sorted(others)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
