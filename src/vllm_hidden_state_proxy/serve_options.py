"""``serve``'s own options: one table (:class:`ServeOptions`), from which its CLI and the table
of them in ``docs/api.md`` are built (a test keeps the docs equal to :func:`options_table`).

``serve`` takes the proxy's options too (its table, ``proxy/settings.py``), minus those it
decides itself (:data:`SERVE_DECIDES`); two of those it offers again with their meaning under
``serve`` (``--ring-dir``, ``--upstream-api-key``), built from the proxy's records
(:func:`~vllm_hidden_state_proxy.option_table.option_like`), so a flag is still written once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_hidden_state_proxy import option_table, tiny_model
from vllm_hidden_state_proxy.option_table import layer_list, option, option_like
from vllm_hidden_state_proxy.protocol import LAYERS_ENV
from vllm_hidden_state_proxy.proxy import settings as proxy_settings

#: Where ``serve`` makes its private ring directory without ``--ring-dir`` (in /dev/shm).
RING_DIR_PREFIX = "vllm-hidden-states-serve-"


_PROXY_OPTIONS = dict(proxy_settings.options())


@dataclass(frozen=True)
class ServeOptions:
    """``serve``'s own options: its CLI (:func:`add_arguments`) and ``docs/api.md``'s table
    (:func:`options_table`)."""

    vllm_port: int | None = option(
        None,
        "--vllm-port",
        "let vLLM listen on 127.0.0.1:PORT instead of a private Unix socket, for tools that must "
        "reach it directly; every local user can then connect to it: vLLM's key guards only /v1 "
        "and a few other paths, not e.g. /invocations or /tokenize",
        metavar="PORT",
        parse=int,
        shown_default="none: a private Unix socket",
    )
    # The proxy's option, with what it means under serve (which also starts vLLM with it).
    upstream_api_key: str | None = option_like(
        _PROXY_OPTIONS["upstream_api_key"],
        None,
        help="the key serve starts vLLM with (as VLLM_API_KEY, never on its command line) and "
        "the proxy sends it; set it only for tools that must reach vLLM directly",
        shown_default="a fresh random key",
    )
    # The proxy's option, whose default under serve is a directory of its own.
    ring_dir: str | None = option_like(
        _PROXY_OPTIONS["ring_dir"],
        None,
        env=None,
        help="shared-memory ring directory (two serves of one model may share one)",
        shown_default=f"a fresh private directory /dev/shm/{RING_DIR_PREFIX}*, removed at exit",
    )
    hidden_state_layers: tuple[int, ...] | None = option(
        None,
        "--hidden-state-layers",
        "layers the worker hook captures, e.g. 4,8,-1 (Transformers' hidden_states indices; -1 "
        f"is the final layer after the final norm). Sets {LAYERS_ENV} for vLLM",
        metavar="LAYERS",
        parse=layer_list,
        shown_default="the final layer only",
    )
    tiny_model: bool = option(
        False,
        "--tiny-model",
        f"serve the built-in tiny model ({tiny_model.DESCRIPTION}; built offline on first use, "
        "as build-tiny-model does) in MODEL's place and under MODEL's name, in "
        "float32 and eager mode: the docs' examples as written, without a GPU or a model hub",
        parse=bool,
    )
    startup_timeout: float = option(
        1800.0,
        "--startup-timeout",
        "give up if vLLM is not healthy after this long (model download and load)",
        metavar="SECONDS",
        parse=float,
    )


#: Proxy settings that ``serve`` decides itself: how the proxy reaches vLLM (its address and
#: key), and its own ``--ring-dir`` and ``--upstream-api-key`` (:class:`ServeOptions`).
SERVE_DECIDES = ("upstream_url", "upstream_uds", "upstream_api_key", "ring_dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s options: the proxy's (minus :data:`SERVE_DECIDES`), then its own."""
    proxy_settings.add_arguments(parser, skip=SERVE_DECIDES)
    option_table.add_arguments(parser, ServeOptions)


def flags() -> set[str]:
    """Every option ``serve`` parses itself (the rest go to vLLM)."""
    proxy = {spec.flag for name, spec in _PROXY_OPTIONS.items() if name not in SERVE_DECIDES}
    own = {spec.flag for _, spec in option_table.options(ServeOptions)}
    return {flag for flag in proxy | own if flag is not None}


def options_table() -> str:
    """The Markdown table of ``serve``'s own options (``docs/api.md`` carries it verbatim)."""
    return option_table.markdown_table(spec for _, spec in option_table.options(ServeOptions))
