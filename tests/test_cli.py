"""The command line (cli.py): ``serve`` and ``proxy`` parse the options table; problems with the
proxy's options stop either command before anything starts."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from vllm_hidden_state_proxy import __version__, check, cli
from vllm_hidden_state_proxy.protocol import API_KEY_ENV, LAYERS_ENV, VLLM_API_KEY_ENV
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


# ---------------------------------------------------------------------------------------------
# vLLM's habits (issue #39): spellings, --model, --version, VLLM_API_KEY, the host and its key
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (API_KEY_ENV, VLLM_API_KEY_ENV):
        monkeypatch.delenv(name, raising=False)


def served_with(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[Any, list[str]]:
    """What ``serve`` is started with for ``argv`` (nothing really starts)."""
    from vllm_hidden_state_proxy import serve

    calls: list[tuple[argparse.Namespace, list[str]]] = []

    def fake_serve(args: argparse.Namespace, extra: list[str]) -> int:
        calls.append((args, extra))
        return 0

    monkeypatch.setattr(serve, "serve", fake_serve)
    assert cli.main(argv) == 0
    ((args, extra),) = calls
    return args, list(extra)


def proxy_settings_with(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> ProxySettings:
    served: list[ProxySettings] = []
    monkeypatch.setattr(proxy_server, "serve_proxy", served.append)
    assert cli.main(argv) == 0
    (settings,) = served
    return settings


@pytest.mark.usefixtures("no_keys")
@pytest.mark.parametrize(
    "spelling",
    [
        ["--api_key", "K", "--hidden_state_layers", "4,-1", "--vllm_port=9001"],
        ["--api-key=K", "--hidden-state-layers=4,-1", "--vllm-port", "9001"],
        ["--api_key=K", "--hidden_state_layers=4,-1", "--vllm_port", "9001"],
    ],
)
def test_serve_understands_vllms_spellings_and_passes_vllms_own_unchanged(
    monkeypatch: pytest.MonkeyPatch, spelling: list[str]
) -> None:
    vllm_own = ["--max_model_len", "4096", "--enforce-eager", "--served_model_name=a_b"]
    args, extra = served_with(monkeypatch, ["serve", "m", *spelling, *vllm_own])
    assert (args.api_key, args.hidden_state_layers, args.vllm_port) == ("K", (4, -1), 9001)
    assert extra == vllm_own  # vLLM reads both spellings of its own options


def test_normalise_flags_touches_only_known_option_names() -> None:
    known = {"--api-key", "--embedding-template"}
    argv = [
        "--api_key=a_b",
        "--embedding_template",
        "--x_y {text}",
        "--other_one",
        "--",
        "--api_key",
    ]
    assert cli.normalise_flags(argv, known) == [
        "--api-key=a_b",  # the value keeps its underscore
        "--embedding-template",
        "--x_y {text}",
        "--other_one",
        "--",
        "--api_key",
    ]


@pytest.mark.usefixtures("no_keys")
def test_proxy_understands_its_options_in_vllms_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = proxy_settings_with(
        monkeypatch, ["proxy", "--upstream=http://v", "--vector_timeout=3", "--api_key", "K"]
    )
    assert (settings.vector_timeout, settings.api_key) == (3.0, "K")


@pytest.mark.usefixtures("no_keys")
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "org/m", "--dtype", "float16"],
        ["serve", "--model=org/m", "--dtype", "float16"],
        ["serve", "org/m", "--model", "org/m", "--dtype", "float16"],
        ["serve", "--dtype", "float16", "--model", "org/m"],
        ["serve", "org/m", "--dtype", "float16"],
    ],
)
def test_serve_takes_the_model_as_vllm_does(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    args, extra = served_with(monkeypatch, argv)
    assert args.model == "org/m"
    assert extra == ["--dtype", "float16"]  # no dangling --model


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--dtype=float16"], "serve needs a model"),
        (["serve", "a", "--model", "b"], "two models: 'b' and 'a'"),
        (["serve", "--model=a", "--model", "b"], "two models: 'a' and 'b'"),
    ],
)
def test_serve_without_one_model_stops(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["serve", "--version"],
        ["proxy", "--version"],
        ["check", "--version"],
        ["extract", "--version"],
        ["build-tiny-model", "--version"],
        ["bench", "--version"],
    ],
)
def test_every_command_says_its_version(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"hidden-state-proxy {__version__}\n"


@pytest.mark.usefixtures("no_keys")
def test_vllm_api_key_is_the_proxys_key_unless_its_own_variable_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VLLM_API_KEY_ENV, "from-vllm")
    args, _ = served_with(monkeypatch, ["serve", "m"])
    assert args.api_key == "from-vllm"
    assert args.host == "0.0.0.0"  # with a key, all interfaces, as vLLM
    settings = proxy_settings_with(monkeypatch, ["proxy", "--upstream=http://v"])
    assert (settings.api_key, settings.host) == ("from-vllm", "0.0.0.0")
    monkeypatch.setenv(API_KEY_ENV, "own")
    assert proxy_settings_with(monkeypatch, ["proxy", "--upstream=http://v"]).api_key == "own"
    monkeypatch.setattr(check, "run_check", lambda *args: (args[1] == "own") - 1)
    assert cli.main(["check", "--url=http://p"]) == 0
    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.setattr(check, "run_check", lambda *args: (args[1] == "from-vllm") - 1)
    assert cli.main(["check", "--url=http://p"]) == 0


@pytest.mark.usefixtures("no_keys")
def test_without_a_key_the_default_host_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = served_with(monkeypatch, ["serve", "m"])
    assert (args.host, args.api_key) == ("127.0.0.1", None)
    assert proxy_settings_with(monkeypatch, ["proxy", "--upstream=http://v"]).host == "127.0.0.1"


@pytest.mark.usefixtures("no_keys")
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "box.example"])
def test_serve_refuses_to_listen_beyond_loopback_without_a_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], host: str
) -> None:
    from vllm_hidden_state_proxy import serve

    monkeypatch.setattr(serve, "serve", lambda *args: pytest.fail("serve started"))
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "m", "--host", host])
    assert caught.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    for named in (f"--host {host}", "--api-key", VLLM_API_KEY_ENV, API_KEY_ENV):
        assert named in message
    assert "--allow-unauthenticated" in message


@pytest.mark.usefixtures("no_keys")
@pytest.mark.parametrize(
    ("options", "environ"),
    [
        (["--allow-unauthenticated"], {}),
        (["--allow_unauthenticated"], {}),
        (["--api-key", "K"], {}),
        ([], {VLLM_API_KEY_ENV: "K"}),
        ([], {API_KEY_ENV: "K"}),
    ],
)
def test_serve_listens_beyond_loopback_with_a_key_or_when_told(
    monkeypatch: pytest.MonkeyPatch, options: list[str], environ: dict[str, str]
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args, extra = served_with(monkeypatch, ["serve", "m", "--host", "0.0.0.0", *options])
    assert args.host == "0.0.0.0" and extra == []


@pytest.mark.usefixtures("no_keys")
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_serve_listens_on_loopback_without_a_key(
    monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    assert served_with(monkeypatch, ["serve", "m", "--host", host])[0].host == host


@pytest.mark.usefixtures("no_keys")
def test_the_proxy_alone_warns_but_listens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a container the proxy needs 0.0.0.0, and the network (a pod, compose's) may be the
    boundary: it says so loudly instead of refusing."""
    settings = proxy_settings_with(monkeypatch, ["proxy", "--upstream=http://v", "--host=0.0.0.0"])
    assert settings.host == "0.0.0.0"
    assert "WARNING: --host 0.0.0.0 listens beyond this machine" in capsys.readouterr().err
    proxy_settings_with(
        monkeypatch, ["proxy", "--upstream=http://v", "--host=0.0.0.0", "--allow-unauthenticated"]
    )
    assert capsys.readouterr().err == ""
