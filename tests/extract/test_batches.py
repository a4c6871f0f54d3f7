"""``extract --batch-size``: inputs of one kind in one request, a failed batch split in halves
until one bad input fails alone, chats through ``/v1/chat/completions/batch`` or, where a proxy
lacks it, one a request; hostile answers to a batch fail no input but its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.extract.fake_proxy import FakeProxy, expected_vector
from tests.extract.runs import corpus, errors, manifest, options, run, table, write_jsonl


def _vectors_match(out: Path) -> None:
    """Every row's vectors are its own prompt's (the fake's are a function of the prompt)."""
    texts = {str(r["id"]): r for r in corpus(64)}
    rows = table(out).to_pylist()
    for row in rows:
        record = texts[row["id"]]
        text = record["prompt"] if "prompt" in record else record["messages"][-1]["content"]
        for layer in (0, 1, 2):
            np.testing.assert_array_equal(row[f"layer_{layer}"], expected_vector(text, layer))


def test_inputs_go_in_batches_of_one_kind_each_row_its_own(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(64))  # 32 texts, 32 chats
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, batch_size=8), fake)
    assert status == 0, stderr
    assert sorted(fake.batches) == [8] * 8  # texts and chats never in one request
    assert len(table(out)) == 64
    _vectors_match(out)
    kinds = [b.get("prompt", b.get("messages")) for b in fake.sent]
    assert sum(isinstance(k, str) for k in kinds) == 32


def test_token_ids_and_texts_are_separate_lists(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [{"id": f"t{i}", "prompt": f"text {i}"} for i in range(5)]
    records += [{"id": f"i{i}", "prompt": [i + 1, 2, 3]} for i in range(5)]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    bodies: list[Any] = []

    def record(_: str, body: dict[str, Any]) -> None:
        bodies.append(body["prompt"])

    fake = FakeProxy(override=record)  # type: ignore[arg-type]
    status, stderr = run(inputs, options(tmp_path / "out", batch_size=5), fake)
    assert status == 0, stderr
    assert sorted(fake.batches) == [5, 5]
    assert len(table(tmp_path / "out")) == 10
    assert sum(isinstance(p, str) for p in bodies) == 5


def test_one_bad_input_in_a_batch_fails_alone_after_the_batch_is_split(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [{"id": i, "prompt": f"text {i}"} for i in range(16)]
    records[5] = {"id": "bad", "prompt": "bad one"}
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, batch_size=16), fake)
    assert status == 1, stderr
    assert sorted(table(out).column("id").to_pylist()) == sorted(
        str(r["id"]) for r in records if r["id"] != "bad"
    )
    [failed] = errors(out)
    assert failed["id"] == "bad" and failed["status"] == 400 and failed["line"] == 6
    # 16, its halves 8 + 8, 4 + 4 of the bad half, 2 + 2, 1 + 1: log2(16) levels
    assert fake.batches[0] == 16 and sorted(fake.batches).count(1) == 2
    assert len(fake.batches) == 1 + 2 * 4
    assert fake.tries["bad one"] == 5


def test_chats_fall_back_to_one_a_request_where_the_route_is_missing(tmp_path: Path) -> None:
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"chat {i}"}]}
             for i in range(12)]  # fmt: skip
    inputs = write_jsonl(tmp_path / "in.jsonl", chats)
    out = tmp_path / "out"
    fake = FakeProxy(chat_batches=False)
    status, stderr = run(inputs, options(out, batch_size=4, concurrency=8), fake)
    assert status == 0, stderr
    assert len(table(out)) == 12
    # the first batch (or both of the first two, sent together) found the 404; then singles
    assert fake.batches.count(4) <= 2 and fake.batches.count(1) == 12


def test_a_400_to_a_chat_batch_whose_chats_pass_alone_means_no_route(tmp_path: Path) -> None:
    """Today's proxy refuses the flag on paths it does not know with a 400."""

    def refuse(_: str, body: dict[str, Any]) -> httpx.Response | None:
        return None

    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"chat {i}"}]}
             for i in range(12)]  # fmt: skip
    inputs = write_jsonl(tmp_path / "in.jsonl", chats)
    fake = FakeProxy(override=refuse)
    original = fake._answer

    def no_batches(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/batch"):
            fake.batches.append(-1)
            error = {"error": {"message": "the flag is not supported there", "code": 400}}
            return httpx.Response(400, json=error)
        return original(request)

    fake._answer = no_batches  # type: ignore[method-assign]
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, batch_size=4, concurrency=4), fake)
    assert status == 0, stderr
    assert fake.batches.count(-1) == 1 and fake.batches.count(1) == 12


HOSTILE_LISTS = {
    "missing index": lambda doc: {**doc, "choices": doc["choices"][:-1]},
    "duplicated index": lambda doc: {
        **doc,
        "choices": [*doc["choices"][:-1], {**doc["choices"][-1], "index": 0}],
    },
    "index beyond": lambda doc: {
        **doc,
        "choices": [*doc["choices"][:-1], {**doc["choices"][-1], "index": 99}],
    },
    "wrong count": lambda doc: {
        **doc,
        "kv_transfer_params": {
            **doc["kv_transfer_params"],
            "last_hidden_states_by_layer": doc["kv_transfer_params"]["last_hidden_states_by_layer"][
                :-1
            ],
            "last_hidden_state_infos": doc["kv_transfer_params"]["last_hidden_state_infos"][:-1],
        },
    },
    "a choice without vector": lambda doc: {
        **doc,
        "kv_transfer_params": {
            **doc["kv_transfer_params"],
            "last_hidden_states_by_layer": [
                *doc["kv_transfer_params"]["last_hidden_states_by_layer"][:-1],
                None,
            ],
        },
    },
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE_LISTS))
def test_a_hostile_answer_to_a_list_is_split_until_it_fails_nothing_else(
    tmp_path: Path, hostile: str
) -> None:
    """Every list answer is mangled; single answers are whole: each input ends written."""
    fake = FakeProxy()
    batch = fake._batch

    def mangled(request: httpx.Request, bodies: list[dict[str, Any]]) -> httpx.Response:
        answer = batch(request, bodies)
        document = HOSTILE_LISTS[hostile](json.loads(answer.content))
        return httpx.Response(200, json=document)

    fake._batch = mangled  # type: ignore[method-assign]
    records = [{"id": i, "prompt": f"text {i}"} for i in range(8)]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, batch_size=8), fake)
    assert status == 0, stderr
    assert sorted(fake.batches) == [1] * 8 + [2] * 4 + [4] * 2 + [8]
    rows = table(out).to_pylist()
    assert len(rows) == 8
    for row in rows:
        np.testing.assert_array_equal(row["layer_0"], expected_vector(f"text {row['id']}", 0))


def test_entries_swapped_between_token_id_prompts_are_no_ones_vectors(tmp_path: Path) -> None:
    """The lists are matched by position; a token-id prompt's entry must say its length, so a
    list answer that gives two prompts each other's entries is split, and each input is
    written with its own vectors, sent alone."""
    fake = FakeProxy()
    batch = fake._batch

    def swapped(request: httpx.Request, bodies: list[dict[str, Any]]) -> httpx.Response:
        document = json.loads(batch(request, bodies).content)
        kv = document["kv_transfer_params"]
        for name in ("last_hidden_states_by_layer", "last_hidden_state_infos"):
            kv[name][0], kv[name][1] = kv[name][1], kv[name][0]
        return httpx.Response(200, json=document)

    fake._batch = swapped  # type: ignore[method-assign]
    records = [{"id": i, "prompt": list(range(1, i + 2))} for i in range(4)]  # lengths 1 to 4
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, batch_size=4), fake)
    assert status == 0, stderr
    assert sorted(fake.batches) == [1] * 4 + [2] * 2 + [4]
    rows = table(out).to_pylist()
    assert len(rows) == 4
    for row in rows:
        text = " ".join(str(t) for t in range(1, int(row["id"]) + 2))
        np.testing.assert_array_equal(row["layer_0"], expected_vector(text, 0))


def test_a_list_answer_that_mangles_one_input_fails_that_input_only(tmp_path: Path) -> None:
    """A lone input whose answers are always bad: the rest of its batch is written."""

    def answer(text: str, _: dict[str, Any]) -> httpx.Response | None:
        if text != "text 3":
            return None
        body = json.dumps({"kv_transfer_params": {"last_hidden_states_by_layer": {"0": "*"}}})
        return httpx.Response(200, content=body)

    records = [{"id": i, "prompt": f"text {i}"} for i in range(8)]
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    status, stderr = run(inputs, options(out, batch_size=8), FakeProxy(override=answer))
    assert status == 1, stderr
    assert sorted(table(out).column("id").to_pylist()) == [str(i) for i in range(8) if i != 3]
    [failed] = errors(out)
    assert failed["id"] == "3" and failed["status"] == 200
    assert failed["reason"].startswith("the answer")


def test_retries_that_run_out_fail_the_batch_whole_without_splitting(tmp_path: Path) -> None:
    records = [{"id": i, "prompt": f"text {i}"} for i in range(4)]
    records[0]["prompt"] = "busy 9 then fine"
    inputs = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    fake = FakeProxy()
    status, stderr = run(inputs, options(out, batch_size=4, retries=2), fake)
    assert status == 1, stderr
    assert len(errors(out)) == 4 and fake.batches == [4, 4, 4]
    assert all("after 2 retries" in e["reason"] for e in errors(out))


def test_in_flight_counts_inputs_and_a_batch_fits_the_proxy(tmp_path: Path) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(64))
    fake = FakeProxy(slots=6)
    status, stderr = run(inputs, options(tmp_path / "out"), fake)  # --batch-size 32 asked
    assert status == 0, stderr
    assert max(fake.batches) == 6 and fake.most_in_flight <= 6
    assert manifest(tmp_path / "out")["runs"][0]["batch_size"] == 6
    fake = FakeProxy(limits={"max_prompts": 5})
    status, stderr = run(inputs, options(tmp_path / "out2"), fake)
    assert status == 0, stderr
    assert max(fake.batches) == 5
