"""The run as a whole (bench/main.py): exit statuses, what the report says about the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.bench.main import _local_pid, _short_cpu, describe, run_bench
from vllm_hidden_state_proxy.bench.options import from_args
from vllm_hidden_state_proxy.cli import build_parser, main


def test_bad_options_exit_2_and_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "--proxy-url", "http://127.0.0.1:9"])
    assert run_bench(args) == 2
    assert "--proxy-url and --vllm-url go together" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--requests", "0"])
    assert exit.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_a_server_that_is_not_there_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--smoke", "--proxy-url", "http://127.0.0.1:9"]
    argv += ["--vllm-url", "http://127.0.0.1:9", "--output-dir", str(tmp_path)]
    assert main(argv) == 1
    assert "cannot list the models of http://127.0.0.1:9" in capsys.readouterr().err


def test_the_report_describes_the_run_but_never_the_key() -> None:
    options = from_args(build_parser().parse_args(["bench", "--api-key", "s3cret", "--smoke"]))
    meta = describe(options)
    assert {"date", "machine", "versions", "mode", "options"} <= set(meta)
    assert "(smoke)" in meta["mode"] and "s3cret" not in json.dumps(meta)
    # The figures' subtitle: short.
    assert meta["host"].endswith("no GPU") and "tiny offline model" in meta["model"]


def test_the_figures_name_the_cpu_briefly() -> None:
    assert (
        _short_cpu("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz") == "Intel Xeon Platinum 8375C"
    )
    assert _short_cpu("AMD EPYC 7B13 64-Core Processor") == "AMD EPYC 7B13 64-Core"


def test_only_servers_on_this_machine_have_a_pid_to_read() -> None:
    assert _local_pid("http://example.com:8000") is None
    assert _local_pid("http://127.0.0.1:9") is None  # nothing listens there
