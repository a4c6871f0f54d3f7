"""The proxy's settings (proxy/settings.py): one table from which the CLI, ``serve``'s child
command line, its secret environment and the docs' option table are built."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hidden_state_proxy.protocol import (
    API_KEY_ENV,
    DEFAULT_RING_DIR,
    DEFAULT_TEMPLATE,
    EMBEDDING_TEMPLATE_ENV,
    RING_DIR_ENV,
    UPSTREAM_API_KEY_ENV,
)
from vllm_hidden_state_proxy.proxy.settings import (
    LOG_LEVELS,
    MIB,
    ProxySettings,
    add_arguments,
    check_template,
    command_line,
    from_arguments,
    is_loopback,
    options,
    options_table,
    secret_environment,
)


def parser_for(environ: dict[str, str] | None = None, **details: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proxy")
    add_arguments(parser, environ={} if environ is None else environ, **details)
    return parser


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ProxySettings:
    parser = parser_for(environ, required=("upstream_url",))
    return from_arguments(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------
# the settings object
# ---------------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = ProxySettings(upstream_url="http://vllm:8000/")
    assert s.upstream_base == "http://vllm:8000"
    assert (s.host, s.port, s.ring_dir) == ("127.0.0.1", 8000, DEFAULT_RING_DIR)
    assert s.ring_owner_uids == tuple(sorted({os.getuid(), 0}))
    assert (s.vector_timeout, s.max_body_bytes) == (5.0, 32 * MIB)
    assert (s.embedding_template, s.embedding_layer, s.embedding_pooling) == (
        DEFAULT_TEMPLATE,
        -1,
        "last",
    )
    assert (s.max_embedding_inputs, s.fan_out_limit) == (2048, 64)
    assert (s.api_key, s.upstream_api_key, s.protect_metrics) == (None, None, False)
    assert (s.max_connections, s.request_timeout, s.log_level) == (1000, None, "info")
    assert s.timeouts == {"connect": 5.0, "read": None, "write": None, "pool": None}


def test_the_constructor_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RING_DIR_ENV, "/from/env")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    s = ProxySettings(upstream_url="http://v")
    assert (s.ring_dir, s.api_key) == (DEFAULT_RING_DIR, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"upstream_url": "vllm:8000"}, "http:// or https://"),
        ({"upstream_url": ""}, "http:// or https://"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_head_bytes": 0}, "max_head_bytes"),
        ({"head_timeout": 0.0}, "head_timeout"),
        ({"body_timeout": -1.0}, "body_timeout"),
        ({"max_client_connections": 0}, "max_client_connections"),
        ({"body_budget_bytes": 0}, "body_budget_bytes"),
        ({"vector_timeout": -1.0}, "vector_timeout"),
        ({"request_timeout": 0.0}, "request_timeout"),
        ({"health_timeout": 0.0}, "health_timeout"),
        ({"metrics_upstream_timeout": 0.0}, "metrics_upstream_timeout"),
        ({"drain_timeout": -1.0}, "drain_timeout"),
        ({"connect_timeout": -1.0}, "connect_timeout"),
        ({"embedding_template": "no placeholder"}, "{text}"),
        ({"embedding_pooling": "max"}, "embedding_pooling"),
        ({"api_key": ""}, "api_key"),
        ({"fan_out_limit": 0}, "fan_out_limit"),
        ({"max_embedding_inputs": 0}, "max_embedding_inputs"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_invalid_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"upstream_url": "http://vllm:8000", **overrides}
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        ProxySettings(**values)


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_every_option_is_on_the_command_line() -> None:
    s = parse(
        [
            "--upstream=http://vllm:8001",
            "--host=0.0.0.0",
            "--port=9000",
            "--ring-dir=/r",
            "--ring-owner-uid=5",
            "--ring-owner-uid=6",
            "--vector-timeout=1.5",
            "--max-body-size=1024",
            "--embedding-template=Q: {text}",
            "--embedding-layer=2",
            "--embedding-pooling=mean",
            "--max-embedding-inputs=3",
            "--max-prompts=5",
            "--max-answer-size=4096",
            "--fan-out-limit=4",
            "--api-key=k1",
            "--protect-metrics",
            "--upstream-api-key=k2",
            "--log-level=debug",
        ]
    )
    assert s == ProxySettings(
        upstream_url="http://vllm:8001",
        host="0.0.0.0",
        port=9000,
        ring_dir="/r",
        ring_owner_uids=(5, 6),
        vector_timeout=1.5,
        max_body_bytes=1024,
        embedding_template="Q: {text}",
        embedding_layer=2,
        embedding_pooling="mean",
        max_embedding_inputs=3,
        max_prompts=5,
        max_answer_bytes=4096,
        fan_out_limit=4,
        api_key="k1",
        protect_metrics=True,
        upstream_api_key="k2",
        log_level="debug",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --upstream"),
        (["--upstream=http://v", "--embedding-pooling=max"], "invalid choice: 'max'"),
        (["--upstream=http://v", "--embedding-layer=last"], "invalid int value: 'last'"),
        (["--upstream=http://v", "--log-level=loud"], "invalid choice: 'loud'"),
    ],
)
def test_the_upstream_is_required_and_values_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_variables_supply_defaults_and_options_win(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {
        RING_DIR_ENV: "/env/rings",
        EMBEDDING_TEMPLATE_ENV: "E: {text}",
        API_KEY_ENV: "env-key",
        UPSTREAM_API_KEY_ENV: "env-vllm-key",
    }
    from_env = parse(["--upstream=http://v"], environ)
    assert (from_env.ring_dir, from_env.embedding_template) == ("/env/rings", "E: {text}")
    assert (from_env.api_key, from_env.upstream_api_key) == ("env-key", "env-vllm-key")
    given_ = parse(["--upstream=http://v", "--ring-dir=/opt", "--api-key=opt-key"], environ)
    assert (given_.ring_dir, given_.api_key) == ("/opt", "opt-key")
    assert parse(["--upstream=http://v"], {RING_DIR_ENV: ""}).ring_dir == DEFAULT_RING_DIR
    monkeypatch.setenv(RING_DIR_ENV, "/process/env")  # without environ=, os.environ is read
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_arguments(parser.parse_args(["--upstream=http://v"])).ring_dir == "/process/env"


def test_the_help_names_variables_and_defaults() -> None:
    text = parser_for({RING_DIR_ENV: "/env"}).format_help()
    assert f"${RING_DIR_ENV} or /env" in " ".join(text.split())
    assert "the proxy's own user and root" in " ".join(text.split())


def test_skipped_fields_keep_their_defaults_or_take_overrides() -> None:
    parser = parser_for(skip=("upstream_url", "ring_dir"))
    args = parser.parse_args(["--port=1"])
    assert not hasattr(args, "upstream_url") and not hasattr(args, "ring_dir")
    s = from_arguments(args, upstream_url="http://u", ring_dir="/r")
    assert (s.upstream_url, s.ring_dir, s.port) == ("http://u", "/r", 1)


# ---------------------------------------------------------------------------------------------
# serve's child: command line plus secret environment reproduce the settings
# ---------------------------------------------------------------------------------------------


def reproduced(s: ProxySettings) -> ProxySettings:
    return parse(command_line(s), secret_environment(s))


def test_the_childs_command_line_reproduces_the_settings() -> None:
    s = ProxySettings(
        upstream_url="http://127.0.0.1:8001",
        port=9000,
        ring_dir="/dev/shm/x y",
        ring_owner_uids=(0, 1000),
        vector_timeout=0.25,
        embedding_template="-{text}",  # starts like an option
        embedding_layer=-2,
        embedding_pooling="mean",
        api_key="proxy secret",
        upstream_api_key="vllm secret",
        protect_metrics=True,
        log_level="warning",
    )
    argv = command_line(s)
    assert reproduced(s) == s
    assert not any("secret" in arg for arg in argv)  # never in a process listing
    assert secret_environment(s) == {
        API_KEY_ENV: "proxy secret",
        UPSTREAM_API_KEY_ENV: "vllm secret",
    }
    assert "--protect-metrics" in argv
    assert argv.count("--ring-owner-uid=0") == 1


def test_without_secrets_there_is_no_secret_environment() -> None:
    s = ProxySettings(upstream_url="http://v")
    assert secret_environment(s) == {}
    assert "--protect-metrics" not in command_line(s)
    assert reproduced(s) == s


texts = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12
)
option_settings = st.builds(
    ProxySettings,
    upstream_url=st.builds(lambda rest: "http://" + rest, texts),
    host=texts,
    port=st.integers(0, 65535),
    ring_dir=texts,
    ring_owner_uids=st.lists(st.integers(0, 1 << 31), min_size=1, max_size=3).map(tuple),
    vector_timeout=st.floats(0, 1e6, allow_nan=False),
    max_body_bytes=st.integers(1, 1 << 40),
    max_head_bytes=st.integers(1, 1 << 30),
    head_timeout=st.floats(1e-3, 1e6, allow_nan=False),
    body_timeout=st.floats(1e-3, 1e6, allow_nan=False),
    max_client_connections=st.integers(1, 1 << 20),
    body_budget_bytes=st.integers(1, 1 << 40),
    embedding_template=st.builds(lambda a, b: a + "{text}" + b, texts, texts),
    embedding_layer=st.integers(-100, 100),
    embedding_pooling=st.sampled_from(["last", "mean"]),
    max_embedding_inputs=st.integers(1, 10_000),
    fan_out_limit=st.integers(1, 10_000),
    max_vectors_bytes=st.integers(1, 1 << 40),
    vectors_budget_bytes=st.integers(1, 1 << 40),
    send_timeout=st.floats(1e-3, 1e6, allow_nan=False),
    api_key=st.none() | texts.filter(bool),
    protect_metrics=st.booleans(),
    allow_unauthenticated=st.booleans(),
    upstream_api_key=st.none() | texts.filter(bool),
    log_level=st.sampled_from(LOG_LEVELS),
    drain_timeout=st.floats(0, 1e6, allow_nan=False),
    metrics_upstream_timeout=st.floats(1e-3, 1e6, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(s=option_settings)
def test_any_settings_survive_the_round_trip(s: ProxySettings) -> None:
    assert reproduced(s) == s
    argv = command_line(s)
    assert not any(arg.startswith(("--api-key", "--upstream-api-key")) for arg in argv)
    assert command_line(reproduced(s)) == argv


def test_every_option_has_a_flag_and_help_and_the_rest_none() -> None:
    with_options = {name for name, _ in options()}
    assert with_options == {
        "upstream_url",
        "upstream_uds",
        "upstream_client",
        "host",
        "port",
        "ring_dir",
        "ring_owner_uids",
        "vector_timeout",
        "max_body_bytes",
        "max_head_bytes",
        "head_timeout",
        "body_timeout",
        "max_client_connections",
        "body_budget_bytes",
        "embedding_template",
        "embedding_layer",
        "embedding_pooling",
        "max_embedding_inputs",
        "max_prompts",
        "max_answer_bytes",
        "max_vectors_bytes",
        "vectors_budget_bytes",
        "send_timeout",
        "fan_out_limit",
        "api_key",
        "protect_metrics",
        "upstream_api_key",
        "workers",
        "log_level",
        "drain_timeout",
        "metrics_upstream_timeout",
        "allow_unauthenticated",
    }
    all_fields = {f.name for f in dataclasses.fields(ProxySettings)}
    assert all_fields - with_options == {
        "max_connections",
        "connect_timeout",
        "request_timeout",
        "health_timeout",
    }
    flags = [spec.flag for _, spec in options()]
    assert len(set(flags)) == len(flags) and all(f and f.startswith("--") for f in flags)
    assert all(spec.help for _, spec in options())
    assert {spec.env for _, spec in options() if spec.secret} == {API_KEY_ENV, UPSTREAM_API_KEY_ENV}


# ---------------------------------------------------------------------------------------------
# the docs
# ---------------------------------------------------------------------------------------------


def test_the_options_table_has_a_row_per_option() -> None:
    lines = options_table().splitlines()
    assert lines[0] == "| option | environment | default | meaning |"
    assert len(lines) == 2 + len(list(options()))
    row = next(line for line in lines if line.startswith("| `--ring-dir`"))
    assert f"`{RING_DIR_ENV}`" in row and f"`{DEFAULT_RING_DIR}`" in row
    assert "| `--protect-metrics` |  | off |" in options_table()
    assert "`--embedding-pooling` `last` \\| `mean`" in options_table()


def test_check_template() -> None:
    assert check_template("a {text} b") == "a {text} b"
    with pytest.raises(ValueError, match=r"must contain \{text\}"):
        check_template("no placeholder")


# ---------------------------------------------------------------------------------------------
# the host and its key (issue #39)
# ---------------------------------------------------------------------------------------------


def test_the_default_host_follows_the_api_key() -> None:
    assert ProxySettings(upstream_url="http://v").host == "127.0.0.1"
    assert ProxySettings(upstream_url="http://v", api_key="k").host == "0.0.0.0"
    assert ProxySettings(upstream_url="http://v", host="10.0.0.1").host == "10.0.0.1"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("box.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_exposure_problem() -> None:
    def problem(**values: Any) -> str | None:
        return ProxySettings(upstream_url="http://v", **values).exposure_problem

    assert problem() is None  # loopback
    assert problem(host="0.0.0.0", api_key="k") is None
    assert problem(host="0.0.0.0", allow_unauthenticated=True) is None
    message = problem(host="0.0.0.0", port=8123)
    assert message is not None
    for named in ("--host 0.0.0.0", "port 8123", API_KEY_ENV, "VLLM_API_KEY", "--api-key"):
        assert named in message
    assert "--allow-unauthenticated" in message
