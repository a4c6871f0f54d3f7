"""One record per setting (:class:`Option`), and what is built from tables of them.

Every setting a user can give is written once, as an :class:`Option`: its default, its help,
how one value is parsed, and how it is given (a command-line ``flag``, an ``env`` variable, or
both). Three tables use it:

- the proxy's :class:`~vllm_hidden_state_proxy.proxy.settings.ProxySettings` and ``serve``'s
  :class:`~vllm_hidden_state_proxy.serve.ServeOptions` (and ``check``'s options): dataclasses
  whose fields carry an :class:`Option` (:func:`option`); :func:`add_arguments` turns them into
  ``argparse`` options;
- the worker hook's environment variables
  (:mod:`vllm_hidden_state_proxy.worker_hook.settings`): plain :class:`Option` records with no
  flag, read with :meth:`Option.read`.

:func:`markdown_table` renders any of them for ``docs/api.md``, between markers that
:func:`marked_section` finds (a test keeps each section equal to its table). :meth:`Option.read`
is the one place an option's variable is read from the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from vllm_hidden_state_proxy.protocol import layer_indices

T = TypeVar("T")


@dataclass(frozen=True)
class Option(Generic[T]):
    """One setting: its default, help and parser, and how it is given."""

    default: T
    help: str
    #: Parses one given value; ``bool`` makes a flag without a value; with ``repeat``, one item
    #: of a repeatable option.
    parse: Callable[[str], T]
    #: The command-line flag, e.g. ``--ring-dir``; None: an environment variable only.
    flag: str | None = None
    #: Environment variable whose value, when set and not empty, replaces the default.
    env: str | None = None
    #: Variables read, in order, when ``env`` is unset or empty (e.g. vLLM's ``VLLM_API_KEY``).
    fallback_env: tuple[str, ...] = ()
    metavar: str | None = None
    #: Passed to ``serve``'s proxy child through ``env`` instead of its command line, and left
    #: out of its table's ``repr``.
    secret: bool = False
    choices: tuple[str, ...] | None = None
    #: How the default reads in help and docs, when the value itself would mislead.
    shown_default: str | None = None
    repeat: bool = False

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value of ``env`` in ``environ`` (default: this process's environment), parsed;
        the default when it is unset or empty. The parser's errors propagate."""
        source = os.environ if environ is None else environ
        for name in self.variables:
            raw = source.get(name)
            if raw:
                return self.parse(raw)
        return self.default

    @property
    def variables(self) -> tuple[str, ...]:
        """The variables this option is read from, first one first."""
        return ((self.env,) if self.env else ()) + self.fallback_env

    @property
    def default_text(self) -> str:
        """The default as help text says it (``none`` for ``None``)."""
        if self.shown_default is not None:
            return self.shown_default
        return "none" if self.default is None else str(self.default)


def option(default: Any, flag: str, help: str, *, parse: Any = str, **details: Any) -> Any:
    """A dataclass field that users can set from the command line (see :class:`Option`)."""
    spec = Option(default, help, parse, flag=flag, **details)
    return field(default=default, repr=not spec.secret, metadata={"option": spec})


def option_like(base: Option[Any], default: Any, **changes: Any) -> Any:
    """A dataclass field for another command's variant of ``base`` (the same flag, its own
    default, help or environment), e.g. ``serve``'s ``--ring-dir``."""
    spec = dataclasses.replace(base, default=default, **changes)
    return field(default=default, metadata={"option": spec})


def layer_list(text: str) -> tuple[int, ...]:
    """Parses a layers option (``serve``'s ``--hidden-state-layers``, ``extract``'s
    ``--layers``): comma-separated layer indices, e.g. ``4,8,-1``; at least one."""
    try:
        layers = layer_indices(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer indices such as 4,8,-1, not {text!r}"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def options(table: type) -> Iterator[tuple[str, Option[Any]]]:
    """(field name, option) for each field of the dataclass ``table`` that has an option."""
    for f in dataclasses.fields(table):
        spec = f.metadata.get("option")
        if spec is not None:
            yield f.name, spec


def add_arguments(
    parser: argparse.ArgumentParser,
    table: type,
    *,
    skip: Sequence[str] = (),
    required: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> None:
    """One ``argparse`` option (``dest`` the field's name) per option of ``table`` with a flag,
    minus ``skip``; an option's variable, when set in ``environ``, gives its default."""
    for name, spec in options(table):
        if name in skip or spec.flag is None:
            continue
        default = spec.read(environ)
        shown = spec.shown_default or ("none" if default is None else str(default))
        if spec.variables:
            shown = " or ".join(f"${name}" for name in spec.variables) + f" or {shown}"
        text = f"{spec.help} (default {shown})"
        if spec.parse is bool:
            parser.add_argument(spec.flag, dest=name, action="store_true", help=spec.help)
        elif spec.repeat:
            parser.add_argument(
                spec.flag,
                dest=name,
                type=spec.parse,
                action="append",
                default=None,
                metavar=spec.metavar,
                help=text,
            )
        else:
            parser.add_argument(
                spec.flag,
                dest=name,
                type=spec.parse,
                default=None if name in required else default,
                required=name in required,
                metavar=spec.metavar,
                choices=spec.choices,
                help=text,
            )


# -- docs ---------------------------------------------------------------------------------------


def _flag_cell(spec: Option[Any]) -> str:
    text = f"`{spec.flag}`" + (f" `{spec.metavar}`" if spec.metavar else "")
    if spec.choices:
        text += " " + " \\| ".join(f"`{choice}`" for choice in spec.choices)
    return text


def _default_cell(spec: Option[Any]) -> str:
    if spec.parse is bool:
        return "off"
    if spec.shown_default is not None:
        return spec.shown_default
    return "none" if spec.default is None else f"`{spec.default}`"


_CELLS: dict[str, Callable[[Option[Any]], str]] = {
    "option": _flag_cell,
    "environment": lambda spec: ", else ".join(f"`{name}`" for name in spec.variables),
    "variable": lambda spec: f"`{spec.env}`",
    "default": _default_cell,
    "meaning": lambda spec: spec.help,
}

#: The columns of a table of command-line options; a table of variables has
#: ``("variable", "default", "meaning")``.
OPTION_COLUMNS = ("option", "environment", "default", "meaning")


def markdown_table(specs: Iterable[Option[Any]], columns: Sequence[str] = OPTION_COLUMNS) -> str:
    """The Markdown table of ``specs``, one row each, with ``columns`` (names in ``_CELLS``)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for spec in specs:
        lines.append("| " + " | ".join(_CELLS[column](spec) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: begin -->\n", f"<!-- {name}: end -->"


def marked_section(document: str, name: str) -> str | None:
    """What ``document`` holds between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``
    (``None`` without both markers)."""
    begin, end = _markers(name)
    _, found, rest = document.partition(begin)
    if not found or end not in rest:
        return None
    return rest.split(end, 1)[0]


def with_section(document: str, name: str, text: str) -> str:
    """``document`` with its section ``name`` (see :func:`marked_section`) replaced by ``text``;
    ``ValueError`` if it has no such section."""
    begin, end = _markers(name)
    if marked_section(document, name) is None:
        raise ValueError(f"no section {name!r} (markers {begin.strip()} ... {end})")
    head, _, rest = document.partition(begin)
    return head + begin + text + end + rest.split(end, 1)[1]
