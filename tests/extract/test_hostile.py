"""``extract`` against hostile answers, corpora and output directories (issue #50): one bad
answer or row fails only itself (a line of the errors file, with its reason), never the run;
each answer, request and line is bounded; ``--resume`` checks the parts and every setting that
changes the vectors; the output directory holds nothing extract did not make; setup problems are
a sentence and exit 2. Against the in-process fake proxy."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import threading
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.extract.fake_proxy import HIDDEN_SIZE, FakeProxy
from tests.extract.runs import corpus, errors, manifest, options, run, table, write_jsonl
from vllm_hidden_state_proxy.extract import dataset, runner, sender
from vllm_hidden_state_proxy.extract.inputs import InputProblem, read_inputs

MIB = 1 << 20


def ids_once(output: Path) -> list[str]:
    ids: list[str] = table(output).column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id twice"
    return ids


def text_answer(body: str | bytes, **headers: str) -> httpx.Response:
    """A 200 answer of these bytes, unread (as a network gives it: a gzip one undecoded)."""
    content = body.encode() if isinstance(body, str) else body
    return httpx.Response(200, stream=httpx.ByteStream(content), headers=headers)


def kv_text(**fields: Any) -> str:
    return json.dumps({"kv_transfer_params": fields})


def gzip_of_zeros(size: int) -> AsyncIterator[bytes]:
    """A gzip stream of ``size`` zero bytes, compressed as it is sent (never whole in memory)."""

    async def produce() -> AsyncIterator[bytes]:
        compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        block = bytes(MIB)
        for _ in range(size // MIB):
            yield compressor.compress(block)
        yield compressor.flush()

    return produce()


#: A 200 answer per name, each of which no row can be made of (the prompt is "hostile NAME").
HOSTILE: dict[str, Callable[[], httpx.Response]] = {
    "overflow": lambda: text_answer(
        '{"kv_transfer_params": {"last_hidden_states_by_layer": {"0": [' + "9" * 401 + "]}}}"
    ),
    "dtype": lambda: text_answer(kv_text(last_hidden_state="AACAPw==", last_hidden_state_dtype=[])),
    "deep": lambda: text_answer('{"kv_transfer_params": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "shape": lambda: text_answer(kv_text(last_hidden_states_by_layer={
        "0": {"shape": [0, 2**70], "dtype": "float32", "data": ""}})),
    "bytes": lambda: text_answer(b'{"kv_transfer_params": {"last_hidden_state": "\xff"}}'),
    "gzip": lambda: text_answer(b"not gzip at all", **{"content-encoding": "gzip"}),
    "brotli": lambda: text_answer(b"\x1b\x00", **{"content-encoding": "br"}),
    "width": lambda: text_answer(kv_text(
        last_hidden_states_by_layer={str(k): "AACAPwAAgD8=" for k in (0, 1, 2)},
        last_hidden_state_info={"position": 1, "num_prompt_tokens": 2})),
}  # fmt: skip


def hostile_proxy(**changes: Any) -> FakeProxy:
    def answer(text: str, _: dict[str, Any]) -> httpx.Response | None:
        words = text.split()
        return HOSTILE[words[1]]() if words[0] == "hostile" else None

    return FakeProxy(override=answer, **changes)


def test_one_bad_answer_and_one_bad_row_fail_alone_and_resume_writes_nothing_new(
    tmp_path: Path,
) -> None:
    """The issue's "done when": 48 rows, two lines of the errors file, exit 1; --resume sends
    the two again, writes nothing new and exits 1 again."""
    records = corpus(48)
    lines = [json.dumps(r) for r in records]
    lines.insert(20, json.dumps({"id": "bad-answer", "prompt": "hostile overflow"}))
    lines.insert(30, '{"id": "bad-row", "messages": [{"role": "user", "content": NaN}]}')
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), hostile_proxy())
    assert status == 1, stderr
    assert len(ids_once(out)) == 48
    by_id = {e["id"]: e for e in errors(out)}
    assert set(by_id) == {"bad-answer", "bad-row"}
    assert by_id["bad-answer"]["status"] == 200
    assert by_id["bad-answer"]["reason"].startswith("the answer: ")
    # orjson reads a number beyond a double's range as no JSON at all
    assert "infinity" in by_id["bad-answer"]["reason"]
    assert by_id["bad-row"]["status"] is None and "NaN" in by_id["bad-row"]["reason"]
    parts = sorted(p.name for p in out.glob("part-*.parquet"))

    status, stderr = run(inputs, options(out, resume=True), hostile_proxy())
    assert status == 1, stderr
    assert "48 skipped" in stderr and "0 inputs written" in stderr
    assert sorted(p.name for p in out.glob("part-*.parquet")) == parts
    assert len(ids_once(out)) == 48 and {e["id"] for e in errors(out)} == set(by_id)
    assert manifest(out)["runs"][-1]["state"] == "finished"


def test_every_hostile_answer_is_its_inputs_failure(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [{"id": "ok", "prompt": "fine"}]
    records += [{"id": name, "prompt": f"hostile {name}"} for name in HOSTILE]
    records += [{"id": "far", "prompt": "far position"}, {"id": "ok2", "prompt": "also fine"}]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), hostile_proxy())
    assert status == 1, stderr
    assert sorted(ids_once(out)) == ["ok", "ok2"]
    by_id = {e["id"]: e for e in errors(out)}
    assert set(by_id) == {*HOSTILE, "far"}
    assert all(e["status"] == 200 and e["reason"].startswith("the answer") for e in by_id.values())
    assert "not JSON" in by_id["deep"]["reason"]
    assert "UTF-8" in by_id["bytes"]["reason"] or "not JSON" in by_id["bytes"]["reason"]
    assert "gzip" in by_id["gzip"]["reason"] and "'br'" in by_id["brotli"]["reason"]
    assert "shape" in by_id["width"]["reason"]
    assert "position 1099511627776" in by_id["far"]["reason"]
    assert manifest(out)["runs"][-1]["state"] == "finished"


def parquet_chats(path: Path) -> Path:
    """Chats whose messages hold a binary or a timestamp field (not JSON), beside good ones."""
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("data", pa.binary()), ("when", pa.timestamp("s"))])  # fmt: skip
    rows = [
        [{"role": "user", "content": "good", "data": None, "when": None}],
        [{"role": "user", "content": "binary", "data": b"\x00\x01", "when": None}],
        [{"role": "user", "content": "time", "data": None, "when": datetime(2026, 1, 1)}],
        [{"role": "user", "content": "good too", "data": None, "when": None}],
    ]
    chats = pa.table({"id": ["a", "b", "c", "d"], "messages": pa.array(rows, pa.list_(message))})
    pq.write_table(chats, path)
    return path


def test_a_row_that_is_not_json_is_its_inputs_failure(tmp_path: Path) -> None:
    lines = [
        '{"id": "nan", "messages": [{"role": "user", "content": "x", "weight": NaN}]}',
        '{"id": "inf", "prompt": "x", "spans": null, "extra": 1e400}',
        '{"id": "\\ud800", "prompt": "a lone surrogate as the id"}',
        '{"id": "surrogate", "prompt": "text \\udc00 with a lone surrogate"}',
        '{"id": "deep", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"id": "ok", "prompt": "fine"}',
    ]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), FakeProxy())
    assert status == 1, stderr
    assert ids_once(out) == ["ok"]
    reasons = {e["line"]: e["reason"] for e in errors(out)}
    assert set(reasons) == {1, 2, 3, 4, 5} and all(e["status"] is None for e in errors(out))
    assert "NaN" in reasons[1] and "Infinity" in reasons[2]
    assert "UTF-8" in reasons[3] and "UTF-8" in reasons[4] and "deep" in reasons[5]

    out = tmp_path / "parquet"
    status, stderr = run(parquet_chats(tmp_path / "in.parquet"), options(out), FakeProxy())
    assert status == 1, stderr
    assert sorted(ids_once(out)) == ["a", "d"]
    reasons = {e["id"]: e["reason"] for e in errors(out)}
    assert "bytes" in reasons["b"] and "messages[0].data" in reasons["b"]
    assert "datetime" in reasons["c"] and "messages[0].when" in reasons["c"]


@pytest.mark.parametrize("content", [b"PAR1 not parquet at all", None], ids=["text", "directory"])
def test_an_input_that_cannot_be_read_stops_before_anything_is_made(
    tmp_path: Path, content: bytes | None
) -> None:
    inputs = tmp_path / "in.parquet"
    if content is None:
        inputs.mkdir()
    else:
        inputs.write_bytes(content)
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out), fake)
    assert status == 2, stderr
    assert str(inputs) in stderr and "Traceback" not in stderr
    assert not out.exists() and not fake.sent


def test_a_jsonl_input_may_be_a_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    lines = "".join(json.dumps(r) + "\n" for r in corpus(5)).encode()

    def write() -> None:
        with fifo.open("wb") as writer:
            writer.write(lines)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        status, stderr = run(fifo, options(tmp_path / "out", progress=True), FakeProxy())
    finally:
        writer.join(30)
    assert status == 0, stderr
    assert len(ids_once(tmp_path / "out")) == 5


# -- bounds ------------------------------------------------------------------------------------


def test_an_answer_is_bounded_by_its_decoded_size(tmp_path: Path) -> None:
    """16 MiB of zeros in 16 KiB of gzip: refused at --max-answer-size, counted decoded."""

    def bomb(text: str, _: dict[str, Any]) -> httpx.Response | None:
        if text != "bomb":
            return None
        headers = {"content-encoding": "gzip"}
        return httpx.Response(200, headers=headers, content=gzip_of_zeros(16 * MIB))

    records = [{"id": "bomb", "prompt": "bomb"}, {"id": "ok", "prompt": "fine"}]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, max_answer_size=MIB), FakeProxy(override=bomb))
    assert status == 1, stderr
    assert ids_once(out) == ["ok"]
    [failed] = errors(out)
    assert failed["id"] == "bomb" and failed["status"] == 200
    assert "--max-answer-size" in failed["reason"] and "1048576" in failed["reason"]

    # an answer in gzip within the bound reads as it would plain
    def zipped(text: str, body: dict[str, Any]) -> httpx.Response | None:
        plain = FakeProxy()._answer(httpx.Request("POST", "http://fake", json=body))
        return text_answer(gzip.compress(plain.content), **{"content-encoding": "gzip"})

    out = tmp_path / "zipped"
    status, stderr = run(inputs, options(out), FakeProxy(override=zipped))
    assert status == 0, stderr


def test_the_default_answer_bound_is_what_the_request_can_carry() -> None:
    from vllm_hidden_state_proxy.extract.limits import VLLM_ANSWER_BYTES, answer_limit

    plan = {"layers": [0, 1, 2], "hidden_size": 1024, "matrix": False, "pooling": "last", "n": 1}
    vectors = answer_limit(plan, max_record_bytes=64 * MIB)
    assert VLLM_ANSWER_BYTES < vectors < VLLM_ANSWER_BYTES + MIB  # 3 vectors: 16 KiB of base64
    plan |= {"matrix": True, "pooling": "all_answer", "n": 4}
    assert answer_limit(plan, max_record_bytes=64 * MIB) > 4 * 64 * MIB * 4 // 3


def trickle(seconds_per_byte: float, count: int) -> AsyncIterator[bytes]:
    async def produce() -> AsyncIterator[bytes]:
        import asyncio

        for _ in range(count):
            await asyncio.sleep(seconds_per_byte)
            yield b" "

    return produce()


def test_timeout_bounds_the_whole_request_not_each_read(tmp_path: Path) -> None:
    """One byte every 20 ms passes any per-read timeout; --timeout is per request."""

    def slow(text: str, _: dict[str, Any]) -> httpx.Response | None:
        return httpx.Response(200, content=trickle(0.02, 1000)) if text == "slow" else None

    records = [{"id": "slow", "prompt": "slow"}, {"id": "ok", "prompt": "fine"}]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy(override=slow)
    # one request an input: a batch that times out fails whole (docs/extract.md)
    status, stderr = run(inputs, options(out, timeout=0.2, retries=1, batch_size=1), fake)
    assert status == 1, stderr
    assert ids_once(out) == ["ok"]
    [failed] = errors(out)
    assert failed["status"] is None and "--timeout 0.2" in failed["reason"]
    assert "after 1 retries" in failed["reason"] and fake.tries["slow"] == 2
    assert "1 retries (timeout: 1)" in stderr


def test_a_line_longer_than_a_proxy_takes_is_not_read_whole(tmp_path: Path) -> None:
    limit = 64 * 1024
    long_line = json.dumps({"id": "long", "prompt": "x" * (2 * limit)})
    near = json.dumps({"id": "near", "prompt": "y" * (limit - 100)})  # its body is over
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        "\n".join([long_line, near, '{"id": "ok", "prompt": "fine"}']) + "\n", encoding="utf-8"
    )
    out = tmp_path / "out"
    fake = FakeProxy(limits={"max_body_bytes": limit})
    status, stderr = run(inputs, options(out), fake)
    assert status == 1, stderr
    assert ids_once(out) == ["ok"] and len(fake.sent) == 1
    reasons = {e["id"]: e["reason"] for e in errors(out)}
    assert set(reasons) == {None, "near"}
    assert f"longer than {limit} bytes" in reasons[None]
    assert "request body" in reasons["near"] and str(limit) in reasons["near"]

    # a 32 MiB line is skipped in pieces, never held
    huge = tmp_path / "huge.jsonl"
    with huge.open("w", encoding="utf-8") as writer:
        writer.write('{"id": "huge", "prompt": "')
        for _ in range(32):
            writer.write("z" * MIB)
        writer.write('"}\n{"id": "after", "prompt": "fine"}\n')
    tracemalloc.start()
    try:
        items = list(read_inputs(huge, max_line_bytes=limit))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(items[0], InputProblem) and items[1].id == "after"
    assert peak < 4 * MIB, peak


def test_ctrl_c_is_handled_among_a_million_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs that are not sent (duplicates, ids already written) give the event loop its turn
    now and then: a signal is handled within a few of them, not after all."""
    lines = ['{"id": "d", "prompt": "first"}'] + ['{"id": "d", "prompt": "again"}'] * 20_000
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    failed = runner.Extraction._fail
    calls = 0

    def fail_and_signal(self: runner.Extraction, *args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 100:
            os.kill(os.getpid(), signal.SIGINT)
        failed(self, *args)

    monkeypatch.setattr(runner.Extraction, "_fail", fail_and_signal)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, concurrency=1), FakeProxy())
    assert status == runner.EXIT_INTERRUPTED, stderr
    assert 100 <= len(errors(out)) < 1000


def test_a_second_signal_while_the_run_wraps_up_still_leaves_the_manifest_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(20))
    fake = FakeProxy()

    async def signal_at_the_5th(number: int) -> None:
        if number == 5:
            os.kill(os.getpid(), signal.SIGINT)
        if number >= 5:
            await fake.stall()

    closing = dataset.DatasetWriter.close

    def close_after_a_second_signal(self: dataset.DatasetWriter) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, while the part is closed
        closing(self)

    fake.on_request = signal_at_the_5th
    monkeypatch.setattr(dataset.DatasetWriter, "close", close_after_a_second_signal)
    out = tmp_path / "out"
    try:
        status, stderr = run(inputs, options(out, concurrency=2, row_group_rows=1), fake)
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C escaped the run's wrap-up")
    assert status == runner.EXIT_INTERRUPTED, stderr
    assert manifest(out)["runs"][-1]["state"] == "interrupted"
    assert not list(out.glob(".*tmp"))


@pytest.mark.parametrize(
    ("after", "wait"),
    [("nan", 0.5), ("-1", 0.5), ("inf", 0.5), ("0.25", 0.25), ("1e12", sender.BACKOFF_MOST)],
)
def test_retry_after_that_is_not_a_wait_means_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: str, wait: float
) -> None:
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(runner, "_sleep", record)
    monkeypatch.setattr(sender, "BACKOFF_FIRST", 0.5)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # no jitter
    inputs = write_jsonl(
        tmp_path / "in.jsonl", [{"id": 1, "prompt": f"refuse 503 1 after {after}"}]
    )
    status, stderr = run(inputs, options(tmp_path / "out"), FakeProxy())
    assert status == 0, stderr
    assert waits == [wait]


# -- the defaults and the summary --------------------------------------------------------------


def test_the_default_in_flight_stays_below_the_proxys_connection_limit(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), FakeProxy(limits={"max_client_connections": 64}))
    assert status == 0, stderr
    assert manifest(out)["runs"][0]["concurrency"] == 32  # half: uvicorn counts finished tasks
    status, stderr = run(inputs, options(tmp_path / "default"), FakeProxy())  # 1024 of each
    assert status == 0 and manifest(tmp_path / "default")["runs"][0]["concurrency"] == 512
    fake = FakeProxy(limits={"max_client_connections": 64})
    status, stderr = run(inputs, options(tmp_path / "more", concurrency=100), fake)
    assert status == 0 and "more than the proxies allow: 63" in stderr
    # a proxy of an earlier release, which does not say it: its rings' slots
    status, stderr = run(inputs, options(tmp_path / "older"), FakeProxy(limits={
        "max_client_connections": None}))  # fmt: skip
    assert status == 0 and manifest(tmp_path / "older")["runs"][0]["concurrency"] == 1024


def test_the_summary_and_the_manifest_count_retries_by_cause(tmp_path: Path) -> None:
    def front_door(text: str, _: dict[str, Any]) -> httpx.Response | None:
        if text == "front door" and fake.tries[text] == 1:
            return httpx.Response(503, text="Service Unavailable")  # uvicorn's, plain text
        return None

    fake = FakeProxy(override=front_door)
    records = [{"id": "a", "prompt": "busy 2 then fine"}, {"id": "b", "prompt": "drop 1 then ok"},
               {"id": "c", "prompt": "refuse 504 1 then fine"},
               {"id": "d", "prompt": "front door"}]  # fmt: skip
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), fake)
    assert status == 0, stderr
    causes = {"503": 2, "503 front server": 1, "504": 1, "connection": 1}
    assert manifest(out)["runs"][0]["retries_by_cause"] == causes
    assert manifest(out)["runs"][0]["retries"] == 5
    assert "5 retries (503: 2, 503 front server: 1, 504: 1, connection: 1)" in stderr


# -- --resume and the output directory ---------------------------------------------------------


def made(tmp_path: Path, **changes: Any) -> tuple[Path, Path]:
    """A finished dataset of 12 inputs, and its corpus of 24."""
    records = corpus(24)
    tmp_path.mkdir(exist_ok=True)
    inputs = write_jsonl(tmp_path / "in.jsonl", records[:12])
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, **changes), FakeProxy())
    assert status == 0, stderr
    return write_jsonl(tmp_path / "in.jsonl", records), out


def edit_manifest(out: Path, **changes: Any) -> None:
    document = manifest(out)
    document.update(changes)
    (out / "_manifest.json").write_text(json.dumps(document), encoding="utf-8")


def refused(inputs: Path, out: Path, *fragments: str, **changes: Any) -> None:
    """A run on ``out`` stops before anything is sent, saying ``fragments``, nothing changed."""
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else None
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, **changes), fake)
    assert status == 2, stderr
    assert "Traceback" not in stderr and not fake.sent
    for fragment in fragments:
        assert fragment in stderr, stderr
    after = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else None
    assert after == before


def test_resume_without_the_manifest_is_refused(tmp_path: Path) -> None:
    inputs, out = made(tmp_path)
    (out / "_manifest.json").unlink()
    refused(inputs, out, "_manifest.json", resume=True, layers=(0,), pooling="mean")


def test_resume_checks_each_parts_schema_and_settings(tmp_path: Path) -> None:
    inputs, out = made(tmp_path)
    edit_manifest(out, dtype="float16")  # the parts are float32
    refused(inputs, out, "part-00000.parquet", "float16", resume=True, dtype="float16")
    edit_manifest(out, dtype="float32", pooling="mean")  # the parts' own settings say "last"
    refused(inputs, out, "part-00000.parquet", "pooling", "'last'", resume=True, pooling="mean")


def test_resume_compares_the_request_body_too(tmp_path: Path) -> None:
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    inputs, out = made(tmp_path, extra_body=thinking)
    assert manifest(out)["extra_body"] == thinking
    refused(inputs, out, "extra_body", resume=True)
    refused(inputs, out, "extra_body", resume=True, extra_body={"temperature": 0.5})
    status, stderr = run(inputs, options(out, resume=True, extra_body=thinking), FakeProxy())
    assert status == 0, stderr


def test_what_extract_did_not_make_is_never_written_truncated_or_removed(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious", encoding="utf-8")
    out = tmp_path / "not-a-dataset"
    out.mkdir()
    (out / "_errors.jsonl").symlink_to(victim)
    refused(inputs, out, "_errors.jsonl")
    refused(inputs, out, "_errors.jsonl", resume=True)
    assert victim.read_text(encoding="utf-8") == "precious"

    out = tmp_path / "errors-of-someone-else"
    out.mkdir()
    (out / "_errors.jsonl").write_text("mine\n", encoding="utf-8")
    refused(inputs, out, "_errors.jsonl")

    out = tmp_path / "temporary-parts"
    out.mkdir()
    (out / ".part-00001.parquet.tmp").write_text("someone's", encoding="utf-8")
    refused(inputs, out, ".part-00001.parquet.tmp", resume=True)

    inputs, out = made(tmp_path / "made")
    (out / ".part-00007.parquet.tmp").symlink_to(victim)  # in a dataset: a link, not a part
    refused(inputs, out, ".part-00007.parquet.tmp", resume=True)
    assert victim.read_text(encoding="utf-8") == "precious"


def test_an_output_that_is_not_a_directory_is_a_sentence(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    refused(inputs, dangling, "dangling")
    afile = tmp_path / "a-file"
    afile.write_text("x", encoding="utf-8")
    refused(inputs, afile, "a-file", "not a directory")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "not JSON"),
        ("[]", "not an object"),
        ('{"runs": "x"}', "runs"),
        (None, "'layers'"),
    ],
    ids=["bad-json", "a-list", "runs-x", "lacks-layers"],
)
def test_a_corrupt_manifest_is_a_sentence(tmp_path: Path, text: str | None, fragment: str) -> None:
    inputs, out = made(tmp_path)
    if text is None:
        document = manifest(out)
        del document["layers"]
        text = json.dumps(document)
    elif text.startswith('{"runs"'):
        text = json.dumps({**manifest(out), "runs": "x"})
    (out / "_manifest.json").write_text(text, encoding="utf-8")
    refused(inputs, out, "_manifest.json", fragment, resume=True)


def test_a_truncated_or_foreign_part_is_a_sentence(tmp_path: Path) -> None:
    inputs, out = made(tmp_path)
    part = out / "part-00000.parquet"
    whole = part.read_bytes()
    part.write_bytes(whole[: len(whole) // 2])
    refused(inputs, out, "part-00000.parquet", resume=True)
    part.write_bytes(whole)
    (out / "part-foo.parquet").write_bytes(whole)
    refused(inputs, out, "part-foo.parquet", resume=True)


# -- what held up ------------------------------------------------------------------------------


def test_ids_are_stored_verbatim_and_name_no_file(tmp_path: Path) -> None:
    ids = ["a/b", "../../escape", "nul\x00byte", "x" * MIB, "part-00000.parquet", "_manifest.json"]
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "fine"} for i in ids])
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), FakeProxy())
    assert status == 0, stderr
    assert sorted(ids_once(out)) == sorted(ids)
    assert sorted(p.name for p in out.iterdir()) == [
        "_errors.jsonl", "_manifest.json", "part-00000.parquet"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]


def test_an_answer_of_another_hidden_size_fails_its_input(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": "w", "prompt": "hostile width"}])
    status, _ = run(inputs, options(tmp_path / "out"), hostile_proxy())
    assert status == 1
    [failed] = errors(tmp_path / "out")
    assert failed["status"] == 200
    assert failed["reason"] == f"the answer's layer 0 has shape (2,), not ({HIDDEN_SIZE},)"


def test_a_dataset_of_an_earlier_release_resumes_with_its_extra_body(tmp_path: Path) -> None:
    """Its manifest has no extra_body and its parts no settings: the first run's command line
    says the request body, the parts' columns are checked."""
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    inputs, out = made(tmp_path, extra_body=thinking)
    document = manifest(out)
    del document["extra_body"]
    document["runs"][0]["command_line"] = ["extract", "--extra-body", json.dumps(thinking)]
    (out / "_manifest.json").write_text(json.dumps(document), encoding="utf-8")
    part = out / "part-00000.parquet"
    pq.write_table(pq.read_table(part).replace_schema_metadata(None), part)
    refused(inputs, out, "extra_body", resume=True)
    status, stderr = run(inputs, options(out, resume=True, extra_body=thinking), FakeProxy())
    assert status == 0, stderr
    assert len(ids_once(out)) == 24
