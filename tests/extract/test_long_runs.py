"""``extract`` over a long run, against the fake proxy: answers that cannot make rows, an error
no input explains, retries and their waits, several proxies, Ctrl-C and SIGTERM, and a run
killed outright that ``--resume`` still checks."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vllm_hidden_state_proxy
from tests.extract.fake_proxy import FakeProxy, routed
from tests.extract.runs import URL, corpus, errors, manifest, options, run, table, write_jsonl
from vllm_hidden_state_proxy.extract import runner, sender

ROOT = Path(__file__).resolve().parents[2]


def ids_once(output: Path) -> set[str]:
    """The dataset's ids, each asserted to be there once."""
    ids = table(output).column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id twice"
    return set(ids)


def test_an_answer_that_cannot_make_rows_is_that_inputs_failure(tmp_path: Path) -> None:
    records = [
        {"id": "ok", "prompt": "fine"},
        {"id": "lacks", "prompt": "lack 1 of the layers"},
        {"id": "garbled", "prompt": "garble the base64"},
        {"id": "odd", "prompt": "odd info"},
        {"id": "ok2", "prompt": "also fine"},
    ]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), FakeProxy())
    assert status == 1, stderr
    assert ids_once(out) == {"ok", "ok2"}
    by_id = {e["id"]: e for e in errors(out)}
    assert set(by_id) == {"lacks", "garbled", "odd"}
    assert all(e["status"] == 200 for e in by_id.values())
    assert by_id["lacks"]["reason"] == "the answer lacked layer 1 (it has [0, 2])"
    assert (
        by_id["garbled"]["reason"].startswith("the answer: ")
        and "base64" in (by_id["garbled"]["reason"])
    )
    assert "position 'three', not an integer" in by_id["odd"]["reason"]
    assert manifest(out)["runs"][-1]["state"] == "finished"

    # one entry for two choices: a row short, which --resume would skip
    status, _ = run(inputs, options(tmp_path / "n2", pooling="last_answer", n=2), FakeProxy())
    assert status == 1
    reasons = {e["reason"] for e in errors(tmp_path / "n2") if e["id"] == "ok"}
    assert reasons == {"the answer held 1 entries, not 2"}


def test_an_error_no_input_explains_stops_every_worker_and_leaves_a_resumable_dataset(
    tmp_path: Path,
) -> None:
    records = corpus(40)
    records[9] = {"id": "x", "prompt": "crash now"}
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy()

    async def hold_after_the_crash(_: int) -> None:
        if fake.tries["crash now"]:
            await fake.stall()

    fake.on_request = hold_after_the_crash
    opts = options(out, concurrency=4, rows_per_file=3, row_group_rows=1)
    status, stderr = run(inputs, opts, fake)
    assert status == runner.EXIT_STOPPED == 3, stderr
    assert "RuntimeError: a bug in the run" in stderr and "run again with --resume" in stderr
    assert "Traceback" in stderr  # a bug's report needs its place
    assert fake.stalled == fake.released  # every other request was cancelled, none timed out
    assert not list(out.glob(".*tmp"))
    held = ids_once(out)
    assert "x" not in held and len(held) < 40
    assert all(e["id"] != "x" for e in errors(out))  # not the input's failure
    last = manifest(out)["runs"][-1]
    assert last["state"] == "stopped" and last["error"] == "RuntimeError: a bug in the run"
    assert manifest(out)["counts"]["ids"] == len(held)

    records[9] = {"id": "x", "prompt": "fine now"}
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    again = FakeProxy()
    status, stderr = run(inputs, options(out, resume=True), again)
    assert status == 0, stderr
    assert ids_once(out) == {str(r["id"]) for r in records}
    assert len(again.sent) == 40 - len(held)
    assert [r["state"] for r in manifest(out)["runs"]] == ["stopped", "finished"]


def test_429_and_504_are_retried_after_retry_after_or_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(runner, "_sleep", record)
    monkeypatch.setattr(sender, "BACKOFF_FIRST", 0.5)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # no jitter
    prompts = [
        "refuse 429 1 after 3 then fine",  # the server's wait
        "refuse 504 2 then fine",  # no Retry-After: 0.5 s, doubled
        "refuse 429 1 after 100 then fine",  # at most BACKOFF_MOST
        "refuse 503 1 after soon then fine",  # not seconds (an HTTP date): the backoff
    ]
    inputs = write_jsonl(
        tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    )
    fake = FakeProxy()
    status, stderr = run(inputs, options(tmp_path / "out", concurrency=1), fake)  # one a batch
    assert status == 0, stderr
    assert waits == [3.0, 0.5, 1.0, sender.BACKOFF_MOST, 0.5]
    assert [fake.tries[p] for p in prompts] == [2, 3, 2, 2]
    assert "5 retries" in stderr and manifest(tmp_path / "out")["runs"][0]["retries"] == 5

    status, _ = run(inputs, options(tmp_path / "few", retries=1, batch_size=1), FakeProxy())
    assert status == 1
    [failed] = errors(tmp_path / "few")
    assert failed["status"] == 504 and failed["reason"] == "refused 504 (after 1 retries)"


def test_requests_spread_over_two_proxies_each_within_its_limit(tmp_path: Path) -> None:
    async def hold(_: int) -> None:
        for _ in range(5):  # a few turns of the loop: requests overlap
            await asyncio.sleep(0)

    small = FakeProxy(slots=3, on_request=hold, instance="a1")
    large = FakeProxy(slots=5, on_request=hold, instance="b2")
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(80))
    out = tmp_path / "out"
    opts = options(out, urls=("http://small", "http://large"))
    status, stderr = run(inputs, opts, routed({"small": small, "large": large}))
    assert status == 0, stderr
    assert manifest(out)["runs"][0]["concurrency"] == 8  # 3 + 5: the default
    assert len(small.sent) + len(large.sent) == 80 and len(ids_once(out)) == 80
    assert len(small.sent) >= 15 and len(large.sent) >= 25, (len(small.sent), len(large.sent))
    assert small.most_in_flight == 3 and 3 <= large.most_in_flight <= 5  # batches of 3

    # one proxy (one vLLM server's rings) under two URLs: its slots count once
    status, _ = run(inputs, options(tmp_path / "twice", urls=(URL, URL)), FakeProxy(slots=6))
    assert status == 0 and manifest(tmp_path / "twice")["runs"][0]["concurrency"] == 6

    other = FakeProxy(model="another")
    status, stderr = run(inputs, opts, routed({"small": FakeProxy(), "large": other}))
    assert status == 2 and "one model only" in stderr and not other.sent


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_closes_the_parts_and_resume_finishes(
    tmp_path: Path, signal_number: int
) -> None:
    records = corpus(40)
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy()

    async def signal_at_the_13th(number: int) -> None:
        if number == 13:
            os.kill(os.getpid(), signal_number)  # the run's loop handles it
        if number >= 13:
            await fake.stall()

    fake.on_request = signal_at_the_13th
    opts = options(out, concurrency=4, batch_size=1, rows_per_file=3, row_group_rows=1)
    status, stderr = run(inputs, opts, fake)
    assert status == runner.EXIT_INTERRUPTED == 130, stderr
    assert "interrupted: run again with --resume" in stderr
    assert fake.stalled and fake.stalled == fake.released
    assert not list(out.glob(".*tmp")) and list(out.glob("part-*.parquet"))
    held = ids_once(out)
    assert 0 < len(held) <= 12
    assert manifest(out)["runs"][-1]["state"] == "interrupted"
    assert manifest(out)["counts"]["ids"] == len(held)

    again = FakeProxy()
    status, stderr = run(inputs, options(out, resume=True), again)
    assert status == 0, stderr
    assert f"{len(held)} skipped" in stderr and len(again.sent) == 40 - len(held)
    assert ids_once(out) == {str(r["id"]) for r in records}
    assert [r["state"] for r in manifest(out)["runs"]] == ["interrupted", "finished"]


_KILLED_RUN = """
import sys
from pathlib import Path

from tests.extract.fake_proxy import FakeProxy
from tests.extract.runs import options
from vllm_hidden_state_proxy.extract.runner import run_extract

inputs, out, marker = map(Path, sys.argv[1:])
fake = FakeProxy()

async def hold_from_the_8th(number: int) -> None:
    if number == 8:  # one at a time: the 7 answers before are written
        marker.touch()
    if number >= 8:
        await fake.stall()

fake.on_request = hold_from_the_8th
opts = options(out, concurrency=1, rows_per_file=5, row_group_rows=1)
run_extract(inputs, opts, command_line=["killed"], transport=fake.transport())
"""


def test_resume_checks_the_settings_of_a_run_killed_outright(tmp_path: Path) -> None:
    records = corpus(20)
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out, marker = tmp_path / "out", tmp_path / "waiting"
    script = tmp_path / "killed_run.py"
    script.write_text(_KILLED_RUN, encoding="utf-8")
    package_root = Path(vllm_hidden_state_proxy.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(package_root)])}
    process = subprocess.Popen(
        [sys.executable, str(script), str(inputs), str(out), str(marker)],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            if process.poll() is not None:
                pytest.fail(f"the run ended first: {process.communicate()[1].decode()}")
            assert time.monotonic() < deadline, "the run did not reach its 8th request in 60 s"
            time.sleep(0.02)
        assert manifest(out)["runs"][-1]["state"] == "running"  # written before sending
        while not list(out.glob(".part-00001.parquet.tmp")):  # written behind the answers
            assert time.monotonic() < deadline, "rows 6 and 7 were not written in 60 s"
            time.sleep(0.02)
        assert [p.name for p in out.glob("part-*.parquet")] == ["part-00000.parquet"]
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL

    status, stderr = run(inputs, options(out), FakeProxy())
    assert status == 2 and "already holds a dataset" in stderr
    status, stderr = run(inputs, options(out, resume=True, layers=(0,)), FakeProxy())
    assert status == 2 and "layers ([0, 1, 2], now [0])" in stderr
    status, stderr = run(inputs, options(out, resume=True, dtype="float16"), FakeProxy())
    assert status == 2 and "dtype" in stderr

    fake = FakeProxy()
    status, stderr = run(inputs, options(out, resume=True), fake)
    assert status == 0, stderr
    assert "5 skipped" in stderr and len(fake.sent) == 15  # the .tmp's two rows sent again
    assert "removed .part-00001.parquet.tmp" in stderr and "never ended (killed?)" in stderr
    assert ids_once(out) == {str(r["id"]) for r in records}
    assert [r["state"] for r in manifest(out)["runs"]] == ["running", "finished"]
    assert manifest(out)["runs"][0]["command_line"] == ["killed"]
