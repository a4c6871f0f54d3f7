"""The bench's command line (bench/options.py): one table of options, --phases among them."""

from __future__ import annotations

import argparse

import pytest

from vllm_hidden_state_proxy.bench import options as bench_options
from vllm_hidden_state_proxy.bench.options import BenchOptions, OptionsError, from_args
from vllm_hidden_state_proxy.cli import build_parser


def parse(*argv: str) -> BenchOptions:
    return from_args(build_parser().parse_args(["bench", *argv]))


def test_the_bench_subcommand_is_wired_into_the_cli() -> None:
    args = build_parser().parse_args(["bench", "--requests", "5"])
    assert isinstance(args, argparse.Namespace) and args.command == "bench" and args.requests == 5


def test_a_default_run_measures_every_phase() -> None:
    options = parse()
    assert options.proxy_url is None and options.requests == bench_options.DEFAULT_REQUESTS
    assert options.concurrency == (1, 4, 16, 64) and options.embedding_batches == (1, 16, 256)
    assert options.rounds == 6
    assert options.throughput_burst(64) == 128  # every connection twice a round
    assert options.throughput_burst(1) * options.rounds >= options.requests
    # About 4 x --requests inputs per arm and batch size over the rounds, >= 1 request a round.
    assert [options.embedding_requests(b) for b in (1, 16, 256)] == [134, 9, 1]
    assert options.cpu_requests == 100


def test_smoke_is_tiny_but_keeps_enough_requests_for_cpu_time() -> None:
    options = parse("--smoke", "--proxy-url", "http://127.0.0.1:1/", "--vllm-url", "http://h:2")
    assert options.proxy_url == "http://127.0.0.1:1"  # trailing slash dropped
    assert (options.requests, options.streams, options.rounds) == (3, 2, 1)
    assert options.throughput_burst(16) == 16
    assert [options.embedding_requests(b) for b in (1, 16, 256)] == [3, 1, 1]
    assert options.cpu_requests == bench_options.MIN_CPU_REQUESTS


def test_the_phases_are_chosen_by_one_option_and_run_in_their_order() -> None:
    assert parse().phases == bench_options.DEFAULT_PHASES
    assert "extract" in bench_options.PHASES and "extract" not in parse().phases
    assert parse("--phases", "embeddings, latency").phases == ("latency", "embeddings")
    assert parse("--embedding-batches", "4, 32").embedding_batches == (4, 32)


def test_the_help_lists_every_phase_in_that_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    phases = text[text.index("--phases LIST") : text.index("--proxy-url URL measure")]
    assert all(f"{name} (" in phases for name in bench_options.PHASES)


def test_the_api_key_defaults_to_the_proxys_variable_and_stays_out_of_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_hidden_state_proxy.protocol import API_KEY_ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse().api_key is None and parse().public()["api_key"] is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse().api_key == "from-env"
    options = parse("--api-key", "s3cret")
    assert options.api_key == "s3cret" and "s3cret" not in repr(options)
    assert options.public()["api_key"] == "(set)"
    assert options.public()["output_dir"] == "bench-results"


def test_vllms_key_defaults_to_the_upstream_variable_and_stays_out_of_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_hidden_state_proxy.protocol import UPSTREAM_API_KEY_ENV

    monkeypatch.delenv(UPSTREAM_API_KEY_ENV, raising=False)
    assert parse().vllm_api_key is None and parse().public()["vllm_api_key"] is None
    monkeypatch.setenv(UPSTREAM_API_KEY_ENV, "from-env")
    assert parse().vllm_api_key == "from-env"
    options = parse("--vllm-api-key", "vk-secret")
    assert "vk-secret" not in repr(options) and options.public()["vllm_api_key"] == "(set)"


@pytest.mark.parametrize(
    "argv", [("--proxy-url", "http://a:1"), ("--vllm-url", "http://a:1")]
)  # the direct arms need vLLM too
def test_a_proxy_without_its_vllm_is_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(OptionsError):
        parse(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ("--requests", "0"),
        ("--concurrency", "1,x"),
        ("--concurrency", "0,4"),
        ("--stream-tokens", "1"),
        ("--embedding-batches", "16,0"),
        ("--api-key", "  "),
        ("--phases", "latency,nope"),
        ("--phases", ","),
    ],
)
def test_bad_values_are_refused_by_the_parser(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        parse(*argv)
    assert exit.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err
