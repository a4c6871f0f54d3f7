"""The command line (cli.py): ``serve`` and ``proxy`` parse the options table; problems with the
proxy's options stop either command before anything starts."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from vllm_hidden_state_proxy import cli
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, LAYERS_ENV
from vllm_hidden_state_proxy.proxy import server as proxy_server
from vllm_hidden_state_proxy.proxy.settings import ProxySettings


def test_serve_takes_its_own_options_and_passes_the_rest_to_vllm() -> None:
    args, extra = cli.build_parser().parse_known_args(
        [
            "serve",
            "org/model",
            "--hidden-state-layers",
            "4,-1",
            "--vllm-port",
            "9001",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--max-model-len",
            "4096",
            "--enforce-eager",
        ]
    )
    assert (args.command, args.model) == ("serve", "org/model")
    assert args.hidden_state_layers == (4, -1)
    assert (args.vllm_port, args.port, args.api_key) == (9001, 9000, "k")
    assert (args.ring_dir, args.startup_timeout) == (None, 1800.0)
    assert not hasattr(args, "upstream_url")  # serve sets it
    assert extra == ["--max-model-len", "4096", "--enforce-eager"]


def test_serve_help_names_the_layers_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert LAYERS_ENV in " ".join(capsys.readouterr().out.split())


def test_proxy_runs_with_settings_from_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[ProxySettings] = []
    monkeypatch.setattr(proxy_server, "serve_proxy", served.append)
    assert cli.main(["proxy", "--upstream=http://vllm:8000", "--ring-dir=/r", "--port=1"]) == 0
    (settings,) = served
    assert (settings.upstream_url, settings.ring_dir, settings.port) == (
        "http://vllm:8000",
        "/r",
        1,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["proxy", "--upstream=http://v", "--dtype", "float16"], "unrecognized arguments: --dtype"),
        (["proxy"], "required: --upstream"),
        (["proxy", "--upstream=vllm:8000"], "http:// or https://"),
        (["proxy", "--upstream=http://v", "--vector-timeout=-1"], "vector_timeout"),
        (["serve", "m", "--embedding-template=no placeholder"], "{text}"),
        (["serve", "m", "--fan-out-limit=0"], "fan_out_limit"),
        (["serve", "m", "--hidden-state-layers=x"], "comma-separated layer indices"),
    ],
)
def test_bad_options_stop_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    def must_not_start(*args: Any) -> Any:
        raise AssertionError("started despite a bad option")

    monkeypatch.setattr(proxy_server, "serve_proxy", must_not_start)
    from vllm_hidden_state_proxy import serve

    monkeypatch.setattr(serve, "serve", must_not_start)
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_gets_the_arguments_and_vllms_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_hidden_state_proxy import serve

    calls: list[tuple[argparse.Namespace, list[str]]] = []

    def fake_serve(args: argparse.Namespace, vllm_args: list[str]) -> int:
        calls.append((args, list(vllm_args)))
        return 7

    monkeypatch.setattr(serve, "serve", fake_serve)
    assert cli.main(["serve", "m", "--ring-dir", "/shared", "--dtype", "float32"]) == 7
    ((args, vllm_args),) = calls
    assert (args.model, args.ring_dir) == ("m", "/shared")
    assert vllm_args == ["--dtype", "float32"]


def test_check_takes_its_options_and_the_api_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_hidden_state_proxy import check

    calls: list[tuple[Any, ...]] = []

    def run_check(*args: Any) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(check, "run_check", run_check)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert cli.main(["check", "--url", "http://p"]) == 0
    assert cli.main(["check", "--url=http://p", "--api-key=k", "--model=m", "--timeout=3"]) == 0
    assert cli.main(["check", "--url=http://p", "--api-key="]) == 0  # empty: the variable
    monkeypatch.delenv(API_KEY_ENV)
    assert cli.main(["check", "--url=http://p"]) == 0
    assert calls == [
        ("http://p", "from-env", None, 120.0),
        ("http://p", "k", "m", 3.0),
        ("http://p", "from-env", None, 120.0),
        ("http://p", None, None, 120.0),
    ]


def test_check_needs_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["check"])
    assert caught.value.code == 2
    assert "required: --url" in capsys.readouterr().err
