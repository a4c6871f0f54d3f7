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
from vllm_hidden_state_proxy.bench import extract_report as er
from vllm_hidden_state_proxy.bench.client import BenchError
from vllm_hidden_state_proxy.bench.figures import write_figures
from vllm_hidden_state_proxy.bench.report import Results, render_markdown
from vllm_hidden_state_proxy.extract.dataset import DatasetWriter, write_manifest

RNG = np.random.default_rng(7)


def vectors(count: int, size: int = 8) -> dict[str, np.ndarray]:
    return {f"in-{i}": RNG.standard_normal(size).astype(np.float32) for i in range(count)}


# -- agreement and pairing --------------------------------------------------------------------


def test_vectors_agree_whatever_order_they_came_in() -> None:
    expected = vectors(20)
    shuffled = dict(reversed(list(expected.items())))
    found = ec.agreement(shuffled, expected)
    assert found.ok and found.compared == 20 and found.min_cosine > 0.9999999
    assert found.cell().startswith("yes")


def test_two_inputs_vectors_swapped_are_caught() -> None:
    expected = vectors(5)
    swapped = dict(expected)
    swapped["in-1"], swapped["in-2"] = expected["in-2"], expected["in-1"]
    found = ec.agreement(swapped, expected)
    assert not found.ok and found.min_cosine < 0.9
    assert found.cell().startswith("**NO**")


def test_a_missing_or_extra_input_fails_the_check_even_if_the_rest_agree() -> None:
    expected = vectors(5)
    fewer = {k: v for k, v in expected.items() if k != "in-3"}
    assert ec.agreement(fewer, expected).missing == ("in-3",)
    assert not ec.agreement(fewer, expected).ok
    more = {**expected, "stranger": RNG.standard_normal(8)}
    assert ec.agreement(more, expected).unexpected == ("stranger",)
    assert not ec.agreement(more, expected).ok
    assert not ec.agreement({}, {}).ok  # nothing compared proves nothing


def test_the_tolerance_is_the_e2e_suites() -> None:
    expected = {"a": np.ones(100, dtype=np.float32)}
    close = {"a": expected["a"] * (1 + 5e-4)}  # relative L2 5e-4: within 1e-3
    far = {"a": expected["a"] + np.linspace(-0.01, 0.01, 100)}  # relative L2 ~6e-3
    assert ec.agreement(close, expected).ok
    assert not ec.agreement(far, expected).ok
    assert not ec.agreement({"a": np.ones(99)}, expected).ok  # another length


def test_a_zero_vector_agrees_only_with_zero() -> None:
    zero = {"a": np.zeros(4)}
    assert ec.agreement(zero, zero).ok
    assert not ec.agreement({"a": np.ones(4)}, zero).ok


def test_by_id_refuses_repeated_ids_and_uneven_lengths() -> None:
    rows = np.ones((3, 2))
    assert list(ec.by_id(["a", "b", "c"], rows)) == ["a", "b", "c"]
    with pytest.raises(BenchError, match="repeated"):
        ec.by_id(["a", "b", "a"], rows)
    with pytest.raises(BenchError, match="2 ids for 3"):
        ec.by_id(["a", "b"], rows)


def test_the_corpus_is_distinct_token_ids() -> None:
    class Tokenizer:
        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            assert not add_special_tokens
            return {"input_ids": [len(word) for word in text.split()]}

    corpus = ec.make_corpus(Tokenizer(), 50)
    assert len({item.id for item in corpus}) == 50
    assert all(item.tokens and all(isinstance(t, int) for t in item.tokens) for item in corpus)
    assert len({len(item.tokens) for item in corpus}) > 10  # lengths vary


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
    assert ec.agreement(found, expected).ok and found.keys() == expected.keys()


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
            return await ec.embeddings_arm(client, "http://pool", corpus, 8, batch)()

    found = asyncio.run(go())
    assert {k: float(v[0]) for k, v in found.items()} == {f"in-{i}": 100.0 + i for i in range(10)}
    assert len(seen) == -(-10 // batch)
    assert all(body["use_activation"] is False for body in seen)  # raw states, not normalised


def test_a_pooling_answer_short_of_a_vector_stops_the_run() -> None:
    corpus = [ec.Item(f"in-{i}", [i + 1]) for i in range(4)]

    async def go() -> None:
        transport = pooling_transport([], reverse=False, drop=True)
        async with httpx.AsyncClient(transport=transport) as client:
            await ec.embeddings_arm(client, "http://pool", corpus, 4, 4)()

    with pytest.raises(BenchError, match="3 vectors for 4 inputs"):
        asyncio.run(go())


def test_bounded_sends_each_item_once_and_never_more_in_flight() -> None:
    in_flight, most, sent = 0, 0, []

    async def send(item: int) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)
        sent.append(item)
        in_flight -= 1

    asyncio.run(ec.bounded(list(range(50)), 7, send))
    assert sorted(sent) == list(range(50)) and most == 7


# -- the report -------------------------------------------------------------------------------


def measured(wrong_extract: bool = False) -> ec.Measured:
    reference = {p: vectors(6) for p in ec.POOLINGS}
    result = ec.Measured(inputs=6, tokens=60, concurrency=4)
    result.reference = {f"reference_{p}": reference[p] for p in ec.POOLINGS}
    result.reference.update({f"best_{p}": reference[p] for p in ec.POOLINGS})
    result.transformers = {
        "best_batch_size": 8,
        "batch_sizes": {"1": {"rate": 100.0}, "8": {"rate": 600.0}},
        "peak_rss_mib": 400.0,
    }
    result.memory = {"generation": 4000.0, "pooling last": 3800.0, "pooling mean": 3900.0}
    for pooling in ec.POOLINGS:
        for name, seconds in ((ec.EXTRACT, 0.06), (ec.POOLING_ONE, 0.04), (ec.POOLING_MANY, 0.02)):
            got = dict(reference[pooling])
            if wrong_extract and name == ec.EXTRACT:
                got.pop("in-0")
            result.tallies[f"{name}|{pooling}"] = ec.Tally([seconds, seconds * 2, seconds], got)
    for name in ("vLLM direct, unflagged", "proxy, unflagged"):
        result.tallies[f"{name}|last"] = ec.Tally([0.05, 0.05, 0.05])
    return result


def test_the_tables_carry_rates_ratios_memory_and_agreement() -> None:
    tables = er.compare_tables(measured())
    main = tables["extract_compare"]
    extract_last = main.rows[0]
    assert extract_last["method"] == ec.EXTRACT and extract_last["pooling"] == "last"
    assert extract_last["vectors/s"] == pytest.approx(100.0)  # 6 inputs, median 0.06 s
    assert extract_last["range over rounds"] == "50-100"
    assert extract_last["/ pooling server (1 a request)"] == pytest.approx(100 / 150)
    assert extract_last["/ Transformers"] == pytest.approx(100 / 600)
    assert str(extract_last["equals Transformers"]).startswith("yes")
    assert main.get(f"{ec.TRANSFORMERS} (batch 8)", "vectors/s") == 600.0
    memory = tables["extract_memory"]
    assert memory.get("generation server + pooling server", "peak RSS MiB") == 7900.0
    parts = tables["extract_parts"]
    assert parts.get("proxy, unflagged", "/ pooling server") == pytest.approx(120 / 150)
    assert parts.get("proxy, flagged (bare client)", "vectors/s") is None  # not measured


def test_a_disagreeing_method_is_marked_in_the_report() -> None:
    tables = er.compare_tables(measured(wrong_extract=True))
    text = render_markdown(Results(meta={}, tables=tables))
    assert "**NO**" in text and "1 missing" in text
    assert ec.TITLE in text and ec.PARTS_TITLE in text and ec.MEMORY_TITLE in text


def test_the_figure_is_a_png_linked_after_the_comparisons_last_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = Results(meta={}, tables=er.compare_tables(measured()))
    (path,) = write_figures(results, tmp_path)
    assert path.name == "extract-throughput.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [link.file for link in results.figures["extract_memory"]] == ["extract-throughput.png"]


# -- options ----------------------------------------------------------------------------------


def test_the_comparison_is_opt_in_and_needs_its_own_servers() -> None:
    from vllm_hidden_state_proxy.bench import options as bench_options
    from vllm_hidden_state_proxy.bench.options import OptionsError

    assert parse().extract_inputs == 0
    assert parse("--extract-compare").extract_inputs == bench_options.EXTRACT_INPUTS
    only = parse("--extract-compare-only", "--smoke", "--extract-concurrency", "32")
    assert only.extract_only and only.extract_inputs == bench_options.SMOKE_EXTRACT_INPUTS
    assert only.extract_concurrency == 32
    with pytest.raises(OptionsError, match="own servers"):
        parse("--extract-compare", "--proxy-url", "http://a", "--vllm-url", "http://b")
    with pytest.raises(OptionsError, match="at least 1"):
        parse("--extract-compare", "--extract-inputs", "0")


# -- the Transformers loop --------------------------------------------------------------------


def test_the_loops_padded_batches_give_each_prompt_its_own_unpadded_vectors() -> None:
    """Right padding without an attention mask (causal attention hides the padding), prompts
    batched by length and put back in corpus order: every batch size gives batch 1's vectors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from vllm_hidden_state_proxy.bench.transformers_loop import POOLINGS, run_corpus

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(config).eval()
    corpus = [[(7 * i + k) % 60 + 1 for k in range(3 + (i * 5) % 11)] for i in range(9)]
    _, alone = run_corpus(model, corpus, 1, pad_id=0)
    _, batched = run_corpus(model, corpus, 4, pad_id=0)
    for pooling in POOLINGS:
        ids = [f"in-{i}" for i in range(len(corpus))]
        found = ec.agreement(ec.by_id(ids, batched[pooling]), ec.by_id(ids, alone[pooling]))
        assert found.ok, (pooling, found)
    with torch.inference_mode():  # batch 1 is the model on the prompt alone
        states = model.model(input_ids=torch.tensor([corpus[5]]), output_hidden_states=True)
    final = states.hidden_states[-1][0]
    np.testing.assert_allclose(alone["last"][5], final[-1].numpy(), rtol=1e-5, atol=1e-6)
    mean = final.to(torch.float64).mean(dim=0).numpy()
    np.testing.assert_allclose(alone["mean"][5], mean, rtol=1e-5, atol=1e-6)
