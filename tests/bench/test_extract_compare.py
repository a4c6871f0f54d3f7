"""The extract comparison's pieces that could go wrong without a sound (bench/extract_compare.py):
vectors paired with their inputs, the agreement check, the dataset read back, the pooling
server's answers decoded, and the report."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.bench.test_options import parse
from vllm_hidden_state_proxy.bench import extract_compare as ec
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.figures import write_figures
from vllm_hidden_state_proxy.bench.options import OptionsError
from vllm_hidden_state_proxy.bench.report import Results, render_markdown
from vllm_hidden_state_proxy.bench.turns import Tally
from vllm_hidden_state_proxy.extract.dataset import DatasetWriter, write_manifest

RNG = np.random.default_rng(7)


def vectors(count: int, size: int = 8) -> dict[str, np.ndarray]:
    return {f"in-{i}": RNG.standard_normal(size).astype(np.float32) for i in range(count)}


# -- agreement and pairing --------------------------------------------------------------------


def ok(actual: dict[str, Any], expected: dict[str, Any]) -> bool:
    return ec.agreement(actual, expected).startswith("yes")


def test_vectors_agree_whatever_order_they_came_in() -> None:
    expected = vectors(20)
    found = ec.agreement(dict(reversed(list(expected.items()))), expected)
    assert found.startswith("yes: cos >= 1.0000000") or found.startswith("yes: cos >= 0.9999999")


def test_two_inputs_vectors_swapped_are_caught() -> None:
    expected = vectors(5)
    swapped = dict(expected)
    swapped["in-1"], swapped["in-2"] = expected["in-2"], expected["in-1"]
    assert ec.agreement(swapped, expected).startswith("**NO**: cos >= ")


def test_a_missing_or_extra_input_fails_the_check_even_if_the_rest_agree() -> None:
    expected = vectors(5)
    fewer = {k: v for k, v in expected.items() if k != "in-3"}
    assert ec.agreement(fewer, expected) == "**NO**: 1 missing, 0 unexpected of 5"
    more = {**expected, "stranger": RNG.standard_normal(8)}
    assert ec.agreement(more, expected) == "**NO**: 0 missing, 1 unexpected of 5"
    assert not ok({}, {})  # nothing compared proves nothing


def test_the_tolerance_is_the_e2e_suites() -> None:
    expected = {"a": np.ones(100, dtype=np.float32)}
    close = {"a": expected["a"] * (1 + 5e-4)}  # relative L2 5e-4: within 1e-3
    far = {"a": expected["a"] + np.linspace(-0.01, 0.01, 100)}  # relative L2 ~6e-3
    assert ok(close, expected)
    assert not ok(far, expected)
    assert ec.agreement({"a": np.ones(99)}, expected) == "**NO**: vectors of another length"


def test_a_zero_vector_agrees_with_nothing() -> None:
    zero = {"a": np.zeros(4)}
    assert not ok(zero, zero) and not ok({"a": np.ones(4)}, zero) and not ok(zero, {"a": [1]})


def test_the_corpus_is_distinct_token_ids() -> None:
    class Tokenizer:
        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            assert not add_special_tokens
            return {"input_ids": [len(word) for word in text.split()]}

    corpus = ec.make_corpus(Tokenizer(), 50)
    assert len({item.id for item in corpus}) == 50
    assert all(item.tokens and all(isinstance(t, int) for t in item.tokens) for item in corpus)
    assert len({len(item.tokens) for item in corpus}) > 10  # lengths vary


def test_each_kind_of_input_is_the_same_text() -> None:
    class Tokenizer:
        chat_template = "{{ messages }}"

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            return {"input_ids": [len(word) for word in text.split()]}

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            assert kwargs == {"tokenize": False, "add_generation_prompt": True}
            return f"<user> {messages[0]['content']} <assistant>"

    [item] = ec.make_corpus(Tokenizer(), 1)
    assert item.record("ids") == {"id": "in-0", "prompt": item.tokens}
    assert item.record("text") == {"id": "in-0", "prompt": item.text}
    assert item.record("chat")["messages"] == [{"role": "user", "content": item.text}]
    assert item.pooling_input("chat") == [6, *item.tokens, 11]  # the template's tokens
    assert item.pooling_input("text") == item.text and item.pooling_input("ids") == item.tokens


# -- the extract dataset, read back -----------------------------------------------------------


def write_dataset(directory: Path, rows: list[tuple[str, int, np.ndarray]], layer: int) -> None:
    directory.mkdir()
    writer = DatasetWriter(
        directory, layers=[layer], hidden_size=4, matrix=False, dtype="float32",
        rows_per_file=3, row_group_rows=2,
    )  # fmt: skip
    for id_, choice, vector in rows:
        writer.add({"id": id_, "choice": choice, "position": 0, "num_prompt_tokens": 1,
                    "num_output_tokens": 1, f"layer_{layer}": vector})  # fmt: skip
    writer.close()
    write_manifest(directory, {"layers": [layer]})


def test_an_extract_dataset_is_read_back_by_id_across_parts(tmp_path: Path) -> None:
    expected = {f"x{i}": RNG.standard_normal(4).astype(np.float32) for i in range(7)}
    write_dataset(tmp_path / "d", [(k, 0, v) for k, v in expected.items()], layer=2)
    found = ec.read_extract_dataset(tmp_path / "d")
    assert ok(found, expected) and found.keys() == expected.keys()


def test_a_dataset_with_a_second_choice_or_a_repeated_id_is_refused(tmp_path: Path) -> None:
    vector = np.ones(4, dtype=np.float32)
    write_dataset(tmp_path / "choices", [("a", 0, vector), ("a", 1, vector)], layer=2)
    with pytest.raises(BenchError, match="choice"):
        ec.read_extract_dataset(tmp_path / "choices")
    write_dataset(tmp_path / "twice", [("a", 0, vector), ("a", 0, vector)], layer=2)
    with pytest.raises(BenchError, match="repeated"):
        ec.read_extract_dataset(tmp_path / "twice")
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(BenchError, match="no manifest"):
        ec.read_extract_dataset(tmp_path / "unfinished")


# -- the pooling server's answers -------------------------------------------------------------


def pooling_transport(seen: list[dict[str, Any]], reverse: bool, drop: bool = False) -> Any:
    """An embeddings server whose vector for tokens [t, ...] is [t, t, t] (base64), listing
    the data in reverse order when ``reverse``, and one short when ``drop``."""

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        inputs = body["input"] if isinstance(body["input"][0], list) else [body["input"]]
        data = [
            {"index": i, "object": "embedding", "embedding": base64.b64encode(
                np.full(3, tokens[0], dtype=np.float32).tobytes()).decode()}
            for i, tokens in enumerate(inputs)
        ]  # fmt: skip
        if reverse:
            data.reverse()
        if drop:
            data.pop()
        return httpx.Response(200, json={"data": data})

    return httpx.MockTransport(answer)


@pytest.mark.parametrize("batch", [1, 4])
def test_pooling_answers_are_paired_by_index_not_by_order(batch: int) -> None:
    corpus = [ec.Item(f"in-{i}", [100 + i, 7]) for i in range(10)]
    seen: list[dict[str, Any]] = []

    async def go() -> dict[str, np.ndarray]:
        async with httpx.AsyncClient(transport=pooling_transport(seen, reverse=True)) as client:
            return await ec.embeddings_arm("http://pool", corpus, 8, batch)(client)

    found = asyncio.run(go())
    assert {k: float(v[0]) for k, v in found.items()} == {f"in-{i}": 100.0 + i for i in range(10)}
    assert len(seen) == -(-10 // batch)
    assert all(body["use_activation"] is False for body in seen)  # raw states, not normalised


def test_a_pooling_answer_short_of_a_vector_stops_the_run() -> None:
    corpus = [ec.Item(f"in-{i}", [i + 1]) for i in range(4)]

    async def go() -> None:
        transport = pooling_transport([], reverse=False, drop=True)
        async with httpx.AsyncClient(transport=transport) as client:
            await ec.embeddings_arm("http://pool", corpus, 4, 4)(client)

    with pytest.raises(BenchError, match="3 vectors for 4 inputs"):
        asyncio.run(go())


# -- the report -------------------------------------------------------------------------------


def measured(wrong_extract: bool = False) -> ec.Measured:
    result = ec.Measured(inputs=6, tokens=60, concurrency=4)
    for pooling in ec.POOLINGS:
        reference = vectors(6)
        for name, seconds in ((ec.EXTRACT, 0.06), (ec.POOLING_ONE, 0.04), (ec.POOLING_MANY, 0.02)):
            got = dict(reference)
            if wrong_extract and name == ec.EXTRACT:
                got.pop("in-0")
            tally = result.tallies[f"{name}|{pooling}"] = Tally()
            for turn in (seconds, seconds * 2, seconds):
                tally.add(6, turn, ())
            result.vectors[f"{name}|{pooling}"] = got
    return result


def test_the_table_carries_rates_ratios_and_agreement() -> None:
    table = ec.compare_table(measured())
    extract_last = table.rows[0]
    assert extract_last["method"] == ec.EXTRACT and extract_last["pooling"] == "last"
    assert extract_last["vectors/s"] == pytest.approx(100.0)  # 6 inputs, median 0.06 s
    assert extract_last["range over rounds"] == "50-100"
    assert extract_last["/ pooling server (32 a request)"] == pytest.approx(100 / 300)
    assert extract_last["input"] == "ids"  # arms named method|pooling: the token-id corpus
    assert str(extract_last["equals the pooling server"]).startswith("yes")
    assert table.rows[1]["equals the pooling server"] == "(the reference)"
    assert [row["method"] for row in table.rows] == [
        ec.EXTRACT,
        ec.POOLING_ONE,
        ec.POOLING_MANY,
    ] * 2


def test_a_disagreeing_method_is_marked_in_the_report() -> None:
    table = ec.compare_table(measured(wrong_extract=True))
    text = render_markdown(Results(meta={}, tables={"extract_compare": table}))
    assert "**NO**: 1 missing" in text and ec.TITLE in text


def test_the_figure_is_a_png_linked_after_the_comparisons_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = Results(meta={}, tables={"extract_compare": ec.compare_table(measured())})
    (path,) = write_figures(results, tmp_path)
    assert path.name == "extract-throughput.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [link.file for link in results.figures["extract_compare"]] == ["extract-throughput.png"]


# -- options ----------------------------------------------------------------------------------


def test_the_comparison_is_opt_in_and_needs_its_own_servers() -> None:
    from vllm_hidden_state_proxy.bench import options as bench_options

    assert "extract" not in parse().phases
    assert parse("--phases", "extract").extract_inputs == bench_options.EXTRACT_INPUTS
    only = parse("--phases", "extract", "--smoke", "--extract-concurrency", "32")
    assert only.phases == ("extract",) and only.extract_inputs == bench_options.SMOKE_EXTRACT_INPUTS
    assert only.extract_concurrency == 32
    with pytest.raises(OptionsError, match="own servers"):
        parse("--phases", "latency,extract", "--proxy-url", "http://a", "--vllm-url", "http://b")
