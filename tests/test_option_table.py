"""option_table.py: the one option record, the argparse options and the Markdown built from a
table of them, and the marked sections of a document that hold such a table."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_hidden_state_proxy.option_table import (
    Option,
    add_arguments,
    layer_list,
    markdown_table,
    marked_section,
    option,
    option_like,
    options,
    with_section,
)

ENV = "OPTION_TABLE_TEST_COUNT"


@dataclass(frozen=True)
class Table:
    count: int = option(3, "--count", "how many", metavar="N", parse=int, env=ENV)
    name: str = option("x", "--name", "a name", choices=("x", "y"))
    loud: bool = option(False, "--loud", "say it", parse=bool)
    tags: tuple[str, ...] = option((), "--tag", "one tag", repeat=True, shown_default="no tags")
    unlisted: int = 7  # a field without an option


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Table, environ={} if environ is None else environ)
    return parser.parse_args(argv)


def test_options_are_the_fields_with_an_option_in_order() -> None:
    assert [name for name, _ in options(Table)] == ["count", "name", "loud", "tags"]
    count = dict(options(Table))["count"]
    assert (count.default, count.flag, count.env, count.parse) == (3, "--count", ENV, int)
    assert Table().count == 3  # the field's default is the option's


@pytest.mark.parametrize(
    ("environ", "value"), [({}, 3), ({ENV: ""}, 3), ({ENV: "5"}, 5), ({"OTHER": "5"}, 3)]
)
def test_read_parses_the_variable_or_gives_the_default(environ: dict[str, str], value: int) -> None:
    assert dict(options(Table))["count"].read(environ) == value


def test_read_without_a_variable_is_the_default_and_errors_propagate() -> None:
    assert Option(4, "no variable", int).read({ENV: "9"}) == 4
    with pytest.raises(ValueError, match="invalid literal"):
        dict(options(Table))["count"].read({ENV: "many"})


def test_read_defaults_to_this_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "11")
    assert dict(options(Table))["count"].read() == 11


def test_add_arguments_builds_each_kind_of_option() -> None:
    args = parse([])
    assert (args.count, args.name, args.loud, args.tags) == (3, "x", False, None)
    args = parse(["--count=4", "--name=y", "--loud", "--tag=a", "--tag=b"])
    assert (args.count, args.name, args.loud, args.tags) == (4, "y", True, ["a", "b"])
    assert not hasattr(args, "unlisted")
    assert parse([], {ENV: "8"}).count == 8


def test_add_arguments_skips_requires_and_explains_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Table, skip=("name",), required=("count",), environ={})
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert not hasattr(parser.parse_args(["--count=1"]), "name")
    text = " ".join(parser.format_help().split())
    assert f"how many (default ${ENV} or 3)" in text
    assert "one tag (default no tags)" in text


def test_an_option_without_a_flag_is_no_argument() -> None:
    @dataclass(frozen=True)
    class Variables:
        hidden: int = field(default=1, metadata={"option": Option(1, "env only", int, env=ENV)})

    parser = argparse.ArgumentParser()
    add_arguments(parser, Variables, environ={ENV: "2"})
    assert vars(parser.parse_args([])) == {}


def test_option_like_keeps_the_base_and_changes_what_it_is_told() -> None:
    base = dict(options(Table))["count"]

    @dataclass(frozen=True)
    class Variant:
        count: int | None = option_like(base, None, env=None, shown_default="as you like")

    variant = dict(options(Variant))["count"]
    assert (variant.flag, variant.metavar, variant.parse) == ("--count", "N", int)
    assert (variant.default, variant.env, variant.shown_default) == (None, None, "as you like")
    assert Variant().count is None


def test_default_text() -> None:
    assert Option(None, "h", str).default_text == "none"
    assert Option(1.5, "h", float).default_text == "1.5"
    assert Option(1, "h", int, shown_default="one").default_text == "one"


def test_markdown_table_of_options() -> None:
    assert markdown_table(spec for _, spec in options(Table)) == (
        "| option | environment | default | meaning |\n"
        "|---|---|---|---|\n"
        f"| `--count` `N` | `{ENV}` | `3` | how many |\n"
        "| `--name` `x` \\| `y` |  | `x` | a name |\n"
        "| `--loud` |  | off | say it |\n"
        "| `--tag` |  | no tags | one tag |\n"
    )


def test_markdown_table_of_variables() -> None:
    specs: list[Option[Any]] = [
        Option(None, "a path", str, env="A", shown_default="(none)"),
        Option(2, "b", int, env="B"),
    ]
    assert markdown_table(specs, ("variable", "default", "meaning")) == (
        "| variable | default | meaning |\n|---|---|---|\n"
        "| `A` | (none) | a path |\n| `B` | `2` | b |\n"
    )


DOCUMENT = "intro\n<!-- t: begin -->\nold\n<!-- t: end -->\noutro\n"


def test_marked_sections() -> None:
    assert marked_section(DOCUMENT, "t") == "old\n"
    assert marked_section(DOCUMENT, "other") is None
    assert marked_section("<!-- t: begin -->\nno end", "t") is None
    updated = with_section(DOCUMENT, "t", "new\n")
    assert updated == "intro\n<!-- t: begin -->\nnew\n<!-- t: end -->\noutro\n"
    assert with_section(updated, "t", "old\n") == DOCUMENT
    with pytest.raises(ValueError, match="no section 'other'"):
        with_section(DOCUMENT, "other", "x")


@pytest.mark.parametrize(
    ("environ", "value"),
    [({}, 3), ({"OLD": "5"}, 5), ({ENV: "7", "OLD": "5"}, 7), ({ENV: "", "OLD": "5"}, 5)],
)
def test_a_fallback_variable_is_read_when_the_own_one_is_unset(
    environ: dict[str, str], value: int
) -> None:
    """E.g. the proxy's key: its own variable, else vLLM's VLLM_API_KEY."""
    spec = Option(3, "how many", int, flag="--count", env=ENV, fallback_env=("OLD",))
    assert spec.read(environ) == value
    assert spec.variables == (ENV, "OLD")
    assert markdown_table([spec]).splitlines()[2] == (
        f"| `--count` | `{ENV}`, else `OLD` | `3` | how many |"
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser, _with(spec), environ=environ)
    assert f"${ENV} or $OLD or {value}" in " ".join(parser.format_help().split())
    assert parser.parse_args([]).count == value


def _with(spec: Option[Any]) -> type:
    @dataclass(frozen=True)
    class One:
        count: int = field(default=spec.default, metadata={"option": spec})

    return One


@pytest.mark.parametrize(
    ("text", "layers"),
    [("4,8,-1", (4, 8, -1)), (" 4 , 8 ", (4, 8)), ("-1", (-1,)), ("0,,2,", (0, 2))],
)
def test_layer_list(text: str, layers: tuple[int, ...]) -> None:
    assert layer_list(text) == layers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected at least one layer index"),
        (",", "expected at least one layer index"),
        ("4,x", "expected comma-separated layer indices such as 4,8,-1, not '4,x'"),
    ],
)
def test_layer_list_refuses(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        layer_list(text)
    assert str(raised.value) == message
