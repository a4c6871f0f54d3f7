"""``extract`` against an in-process fake proxy: reading inputs, the dataset's rows, failures
in the errors file, retries, ``--resume``, and the limits on concurrency."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.extract.fake_proxy import HIDDEN_SIZE, FakeProxy, expected_vector
from tests.extract.runs import corpus, errors, manifest, options, run, table, write_jsonl
from vllm_hidden_state_proxy.extract.inputs import Input, InputProblem, read_inputs
from vllm_hidden_state_proxy.extract.runner import run_extract


def test_read_inputs_checks_each_line_and_refuses_a_second_id(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": "a", "prompt": "x"}\n'
        "not json\n"
        "\n"
        '{"id": 7, "prompt": [1, 2, 3]}\n'
        '{"prompt": "no id"}\n'
        '{"id": "b", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}\n'
        '{"id": "a", "messages": [{"role": "user", "content": "again"}]}\n'
        '{"id": "c", "prompt": []}\n',
        encoding="utf-8",
    )
    items = list(read_inputs(path))
    assert items[0] == Input(1, "a", None, "x")
    assert isinstance(items[1], InputProblem) and items[1].line == 2
    assert items[2] == Input(4, "7", None, [1, 2, 3])
    problems = [(i.line, i.id, i.reason) for i in items if isinstance(i, InputProblem)]
    assert [(line, id_) for line, id_, _ in problems] == [
        (2, None), (5, None), (6, "b"), (7, "a"), (8, "c")
    ]  # fmt: skip
    assert "duplicate id (first at line 1)" in problems[3][2]


def test_parquet_inputs_read_as_jsonl_does(tmp_path: Path) -> None:
    records = corpus(6)
    path = tmp_path / "in.parquet"
    chats = pa.table({"id": [r["id"] for r in records if "messages" in r],
                      "messages": [r["messages"] for r in records if "messages" in r]})  # fmt: skip
    pq.write_table(chats, path)
    items = list(read_inputs(path))
    assert [i.id for i in items] == ["c1", "c3", "c5"]
    assert items[0] == Input(1, "c1", [{"role": "user", "content": "chat 1"}], None)


def test_a_corpus_becomes_one_row_per_input_with_the_answer_vectors(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(50))
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, row_group_rows=7, rows_per_file=20), fake)
    assert status == 0, stderr
    data = table(out)
    assert sorted(data.column("id").to_pylist()) == sorted(str(r["id"]) for r in corpus(50))
    assert data.schema.field("layer_2").type == pa.list_(pa.float32(), HIDDEN_SIZE)
    assert len(list(out.glob("part-*.parquet"))) == 3  # 20 + 20 + 10
    by_id = {r["id"]: r for r in data.to_pylist()}
    for record in corpus(50):
        text = record["prompt"] if "prompt" in record else record["messages"][-1]["content"]
        row = by_id[str(record["id"])]
        for layer in (0, 1, 2):
            np.testing.assert_array_equal(row[f"layer_{layer}"], expected_vector(text, layer))
        assert (row["position"], row["num_prompt_tokens"], row["choice"]) == (3, 4, 0)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["layers"] == [0, 1, 2] and manifest["hidden_size"] == HIDDEN_SIZE
    assert manifest["counts"] == {"rows": 50, "ids": 50}
    assert manifest["capture"]["object"] == "hidden_state_capture"
    assert manifest["runs"][0]["command_line"] == ["test"]
    assert errors(out) == []
    assert "50 inputs written" in stderr
    assert not list(out.glob(".*tmp"))


def test_failures_go_to_the_errors_file_and_the_status_says_so(tmp_path: Path) -> None:
    records = [
        {"id": "ok", "prompt": "fine"},
        {"id": "long", "prompt": "bad and too long"},
        {"id": "ok", "prompt": "a second ok"},
        {"id": "busy", "prompt": "busy 99 forever"},
    ]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, _ = run(inputs, options(out, retries=2), FakeProxy())
    assert status == 1
    assert table(out).column("id").to_pylist() == ["ok"]
    by_id = {e["id"]: e for e in errors(out)}
    assert set(by_id) == {"long", "ok", "busy"}
    assert by_id["long"]["status"] == 400 and by_id["long"]["reason"] == "too long"
    assert by_id["ok"]["line"] == 3 and "duplicate" in by_id["ok"]["reason"]
    assert by_id["busy"]["status"] == 503 and "after 2 retries" in by_id["busy"]["reason"]


def test_busy_answers_and_dropped_connections_are_retried(tmp_path: Path) -> None:
    records = [{"id": "a", "prompt": "busy 2 then fine"}, {"id": "b", "prompt": "drop 3 then ok"}]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, batch_size=1), fake)  # one request an input
    assert status == 0, stderr
    assert sorted(table(out).column("id").to_pylist()) == ["a", "b"]
    assert fake.tries == {"busy 2 then fine": 3, "drop 3 then ok": 4}
    assert "5 retries" in stderr


def test_resume_skips_what_the_dataset_holds_and_refuses_other_settings(tmp_path: Path) -> None:
    records = corpus(30)
    inputs = write_jsonl(tmp_path / "in.jsonl", records[:12])
    out = tmp_path / "out"
    assert run(inputs, options(out), FakeProxy())[0] == 0
    (out / ".part-00009.parquet.tmp").write_bytes(b"half a part of a killed run")
    status, stderr = run(inputs, options(out), FakeProxy())
    assert status == 2 and "--resume" in stderr
    status, stderr = run(inputs, options(out, resume=True, layers=(0,)), FakeProxy())
    assert status == 2 and "layers" in stderr
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, resume=True), fake)
    assert status == 0, stderr
    assert len(fake.sent) == 18 and "12 skipped" in stderr
    ids = table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(str(r["id"]) for r in records)  # none lost, none twice
    assert not (out / ".part-00009.parquet.tmp").exists()
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["runs"]) == 2 and manifest["counts"]["ids"] == 30


def test_concurrency_stays_within_the_proxy_slots(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(40))
    fake = FakeProxy(slots=4)
    status, stderr = run(inputs, options(tmp_path / "out", concurrency=100), fake)
    assert status == 0
    assert "more than the proxies allow: 4" in stderr
    assert 1 < fake.most_in_flight <= 4


def test_the_default_concurrency_is_what_the_proxy_allows(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out), FakeProxy(slots=300))
    assert status == 0 and "more than the proxies allow" not in stderr
    assert manifest(out)["runs"][0]["concurrency"] == 300  # not a guess at vLLM's batch
    status, _ = run(inputs, options(tmp_path / "n3", n=3), FakeProxy(slots=300))
    assert status == 0 and manifest(tmp_path / "n3")["runs"][0]["concurrency"] == 100


def test_float16_is_asked_for_and_stored(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    out = tmp_path / "out"
    fake = FakeProxy()
    assert run(inputs, options(out, dtype="float16", layers=(-1,)), fake)[0] == 0
    assert fake.sent[0]["kv_transfer_params"]["last_hidden_state_dtype"] == "float16"
    data = table(out)
    assert data.column_names[-1] == "layer_2"
    assert data.schema.field("layer_2").type == pa.list_(pa.float16(), HIDDEN_SIZE)
    row = data.to_pylist()[0]
    want = expected_vector("text 0", 2).astype(np.float16)
    np.testing.assert_array_equal(np.array(row["layer_2"], np.float16), want)


def test_an_uncaptured_layer_stops_before_anything_is_sent(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(3))
    fake = FakeProxy()
    status, stderr = run(inputs, options(tmp_path / "out", layers=(5,)), fake)
    assert status == 2 and "does not capture layer(s) [5]" in stderr and not fake.sent


def test_matrices_are_lists_of_vectors_one_per_position_or_span(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_hidden_state_proxy.extract import dataset

    monkeypatch.setattr(dataset, "ROW_GROUP_BYTES", 3 * HIDDEN_SIZE * 4)  # "a"'s matrix
    records = [{"id": "a", "prompt": "one two three"}, {"id": "b", "prompt": "four"}]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    assert (
        run(inputs, options(out, pooling="all_prompt", layers=(1,), concurrency=1), FakeProxy())[0]
        == 0
    )
    data = pq.read_table(out)  # the parts alone: _manifest.json and _errors.jsonl are skipped
    # "a" filled a row group by its bytes alone; "b" was written at the end
    assert pq.ParquetFile(next(out.glob("part-*.parquet"))).metadata.num_row_groups == 2
    field = data.schema.field("layer_1").type
    assert field == pa.list_(pa.list_(pa.float32(), HIDDEN_SIZE))
    column = data.column("layer_1").combine_chunks()
    rows = column.values.values.to_numpy().reshape(-1, HIDDEN_SIZE)
    offsets = column.offsets.to_numpy()
    for i, id_ in enumerate(data.column("id").to_pylist()):
        text = {"a": "one two three", "b": "four"}[id_]
        want = [expected_vector(f"{text}#{r}", 1) for r in range(len(text.split()))]
        np.testing.assert_array_equal(rows[offsets[i] : offsets[i + 1]], np.stack(want))

    spans = [{"id": "s", "prompt": "five six", "spans": [[0, 1], [0, 2], [1, 2]]}]
    inputs = write_jsonl(tmp_path / "spans.jsonl", [*spans, {"id": "t", "prompt": "no spans"}])
    fake = FakeProxy()
    status, _ = run(inputs, options(tmp_path / "spans", spans=True), fake)
    assert status == 1  # "t" has no spans
    assert fake.sent[0]["kv_transfer_params"]["last_hidden_state_spans"] == spans[0]["spans"]
    assert fake.sent[0]["kv_transfer_params"]["last_hidden_state_pooling"] == "mean"
    row = pq.read_table(tmp_path / "spans").to_pylist()[0]
    assert len(row["layer_2"]) == 3
    assert errors(tmp_path / "spans")[0]["id"] == "t"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_rate_and_eta_on_a_terminal_only(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(10))
    terminal = _Terminal()
    opts = options(tmp_path / "tty")
    status = run_extract(
        inputs, opts, command_line=["x"], transport=FakeProxy().transport(), stderr=terminal
    )
    assert status == 0
    assert "\rextract: 10/10 inputs, 10 written, 0 failed" in terminal.getvalue()
    assert "ETA" in terminal.getvalue() or "/s" in terminal.getvalue()
    status, stderr = run(inputs, options(tmp_path / "pipe"), FakeProxy())
    assert status == 0 and "\r" not in stderr


def test_the_command_line_needs_a_url_and_reads_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_hidden_state_proxy.cli import build_parser, main
    from vllm_hidden_state_proxy.extract.options import options_from_arguments

    with pytest.raises(SystemExit):
        main(["extract", "in.jsonl", "--output", str(tmp_path)])
    assert "--url" in capsys.readouterr().err
    monkeypatch.setenv("HIDDEN_STATE_PROXY_API_KEY", "secret")
    args = build_parser().parse_args(
        ["extract", "in.jsonl", "--url", "a", "--url", "b", "--output", "o", "--layers", "0,-1"]
    )
    parsed = options_from_arguments(args)
    assert parsed.urls == ("a", "b") and parsed.layers == (0, -1) and parsed.api_key == "secret"
    assert parsed.resume is False and parsed.pooling == "last"
