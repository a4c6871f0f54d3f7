"""docs/api.md's tables of options and variables are the code's tables, rendered: each sits
between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` and must equal its renderer's output.

After changing a table, rewrite the docs with ``python -m tests.test_docs_tables``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_hidden_state_proxy import serve_options
from vllm_hidden_state_proxy.option_table import marked_section, with_section
from vllm_hidden_state_proxy.proxy import settings as proxy_settings
from vllm_hidden_state_proxy.worker_hook import settings as hook_settings

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"

#: Each marked section of docs/api.md, and the table it holds.
TABLES: dict[str, Callable[[], str]] = {
    "serve-options-table": serve_options.options_table,
    "proxy-options-table": proxy_settings.options_table,
    "hook-environment-table": hook_settings.environment_table,
}


def rendered(document: str) -> str:
    """``document`` with every section of :data:`TABLES` rendered anew."""
    for name, table in TABLES.items():
        document = with_section(document, name, table())
    return document


@pytest.mark.parametrize("name", sorted(TABLES))
def test_docs_api_md_carries_the_table(name: str) -> None:
    section = marked_section(API_MD.read_text(encoding="utf-8"), name)
    assert section is not None, f"docs/api.md has no section {name}"
    assert section == TABLES[name](), (
        f"docs/api.md's {name} differs from the code's: run `python -m tests.test_docs_tables`"
    )


if __name__ == "__main__":
    API_MD.write_text(rendered(API_MD.read_text(encoding="utf-8")), encoding="utf-8")
