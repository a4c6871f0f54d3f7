"""A body the proxy re-encodes means to vLLM what the client's meant, number for number (issue
#36, item 7): integers beyond 64 bits and numbers that overflow to an infinity, through the real
proxy (uvicorn, a real ring) to the fake vLLM, compared with what vLLM's parser (Python's
``json``) reads from the client's own body."""

from __future__ import annotations

import json
import math
import timeit
from collections.abc import Iterator
from typing import Any

import pytest

from tests.proxy.fakes import settings_for
from tests.proxy.raw_http import (
    FLAG,
    Served,
    assert_vector_reply,
    exchange,
    request,
    serving,
)
from vllm_hidden_state_proxy.proxy.inspection import (
    Flagged,
    Ordinary,
    encode_document,
    inspect_body,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    settings = settings_for(
        str(tmp_path_factory.mktemp("rings")), vector_timeout=2.0, port=0, log_level="warning"
    )
    with serving(settings) as served:
        yield served
        assert served.errors.records == []


WIDE = [
    b"18446744073709551616",  # 2**64: orjson reads it as a float
    b"-9223372036854775809",  # below int64
    b"1180591620717411303424",  # 2**70
    b"1" + b"0" * 400,  # an integer of 401 digits
]
NON_FINITE = [b"1e999", b"-1e999", b"1" + b"0" * 400 + b".5", b"Infinity", b"-Infinity"]


def same_to_vllm(sent: Any, original: Any) -> bool:
    """The same JSON value as vLLM's parser reads them: ints stay ints, an infinity the same
    infinity, NaN a NaN."""
    if isinstance(original, float) and math.isnan(original):
        return isinstance(sent, float) and math.isnan(sent)
    if type(sent) is not type(original):
        return False
    if isinstance(original, dict):
        return sent.keys() == original.keys() and all(
            same_to_vllm(sent[k], v) for k, v in original.items()
        )
    if isinstance(original, list):
        return len(sent) == len(original) and all(map(same_to_vllm, sent, original))
    return bool(sent == original)


def body_with(number: bytes, flag: bytes = FLAG) -> bytes:
    return (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": '
        + number
        + b', "vllm_xargs": {"x": '
        + number
        + b'}, "logit_bias": {"5": '
        + number
        + b"}, "
        + flag
        + b"}"
    )


@pytest.mark.parametrize("number", WIDE + NON_FINITE + [b"NaN"])
def test_numbers_reach_vllm_as_the_client_wrote_them(served: Served, number: bytes) -> None:
    served.seen_before = len(served.upstream)
    body = body_with(number)
    reply = exchange(served.port, request(body))
    assert_vector_reply(reply, served)
    sent = json.loads(served.new_upstream[-1].content)
    original = json.loads(body)
    for name in ("seed", "logit_bias"):
        assert same_to_vllm(sent[name], original[name]), (sent[name], original[name])
    assert same_to_vllm(sent["vllm_xargs"]["x"], original["vllm_xargs"]["x"])
    if number in WIDE:  # integers come back digit for digit
        assert number in served.new_upstream[-1].content


@pytest.mark.parametrize("number", WIDE + NON_FINITE)
def test_a_body_without_the_flag_re_encoded_keeps_its_numbers(number: bytes) -> None:
    body = body_with(number, b'"kv_transfer_params": {"return_last_hidden_state": false}')
    decision = inspect_body(body)
    assert isinstance(decision, Ordinary) and decision.body != body  # rewritten
    sent, original = json.loads(decision.body), json.loads(body)
    assert same_to_vllm(sent["seed"], original["seed"])


def test_ordinary_numbers_still_take_the_fast_path() -> None:
    """Digits in strings or long fractions are harmless look-alikes (json reads them the same);
    64-bit integers and ordinary floats keep orjson's reading."""
    for number in (b"9223372036854775807", b"0.12345678901234567891", b"1e300", b"-0.0"):
        decision = inspect_body(body_with(number))
        assert isinstance(decision, Flagged)
        assert same_to_vllm(decision.document["seed"], json.loads(number))
        assert same_to_vllm(
            json.loads(encode_document(decision.document))["seed"], json.loads(number)
        )


def test_the_cost_of_reading_a_typical_flagged_body(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a limit, a number for the report: a typical flagged chat body (~1.5 KB)."""
    messages = [{"role": "user", "content": "word " * 250}]
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 16, "n": 2}).encode()
    body = body[:-1] + b", " + FLAG + b"}"
    runs = 2000
    per_call = timeit.timeit(lambda: inspect_body(body), number=runs) / runs
    with capsys.disabled():
        print(f"\ninspect_body of a {len(body)}-byte flagged body: {per_call * 1e6:.1f} us")
