"""serve_options.py: serve's own options, one table (its CLI and docs/api.md's table; the docs
are checked in test_docs_tables.py)."""

from __future__ import annotations

import argparse

import pytest

from vllm_hidden_state_proxy import serve_options
from vllm_hidden_state_proxy.option_table import options
from vllm_hidden_state_proxy.protocol import LAYERS_ENV, UPSTREAM_API_KEY_ENV
from vllm_hidden_state_proxy.proxy import settings as proxy_settings
from vllm_hidden_state_proxy.serve_options import SERVE_DECIDES, ServeOptions


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser()
    serve_options.add_arguments(built)
    return built


def test_serves_options_and_their_defaults() -> None:
    args = parser().parse_args([])
    assert (args.vllm_port, args.ring_dir, args.hidden_state_layers) == (None, None, None)
    assert args.startup_timeout == 1800.0
    assert not hasattr(args, "upstream_url")
    assert args.port == 8000  # the proxy's own options come too
    args = parser().parse_args(
        ["--vllm-port=9", "--ring-dir=/r", "--hidden-state-layers=0,-1", "--startup-timeout=5"]
    )
    assert (args.vllm_port, args.ring_dir, args.hidden_state_layers) == (9, "/r", (0, -1))
    assert args.startup_timeout == 5.0


def test_the_upstream_key_comes_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPSTREAM_API_KEY_ENV, "chosen")
    assert parser().parse_args([]).upstream_api_key == "chosen"
    monkeypatch.setenv(UPSTREAM_API_KEY_ENV, "")
    assert parser().parse_args([]).upstream_api_key is None


def test_the_ring_dir_ignores_the_proxys_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's default is a fresh private directory, whatever the proxy's variable says."""
    monkeypatch.setenv("HIDDEN_STATE_PROXY_RING_DIR", "/elsewhere")
    assert parser().parse_args([]).ring_dir is None


def test_serves_variants_of_proxy_options_keep_the_proxys_flags() -> None:
    proxy = dict(proxy_settings.options())
    own = dict(options(ServeOptions))
    for name in ("ring_dir", "upstream_api_key"):
        assert name in SERVE_DECIDES
        assert (own[name].flag, own[name].metavar) == (proxy[name].flag, proxy[name].metavar)
        assert own[name].help != proxy[name].help and own[name].default is None
    assert own["upstream_api_key"].env == UPSTREAM_API_KEY_ENV


def test_every_flag_once_and_the_layers_variable_named() -> None:
    flags = [action.option_strings[0] for action in parser()._actions if action.option_strings]
    assert len(flags) == len(set(flags))
    help_text = " ".join(parser().format_help().split())
    assert f"Sets {LAYERS_ENV} for vLLM" in help_text


def test_the_options_table_has_a_row_per_option() -> None:
    lines = serve_options.options_table().splitlines()
    assert lines[0] == "| option | environment | default | meaning |"
    assert len(lines) == 2 + len(list(options(ServeOptions)))
    assert f"| `--upstream-api-key` `KEY` | `{UPSTREAM_API_KEY_ENV}` | a fresh random key |" in (
        serve_options.options_table()
    )
