"""The docs' tables of options and variables (docs/api.md, docs/extract.md, docs/benchmark.md)
are the code's tables, rendered: each sits between ``<!-- NAME: begin -->`` and
``<!-- NAME: end -->`` and must equal its renderer's output.

After changing a table, rewrite the docs with ``python -m tests.test_docs_tables``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_hidden_state_proxy import serve_options
from vllm_hidden_state_proxy.bench import options as bench_options
from vllm_hidden_state_proxy.extract import options as extract_options
from vllm_hidden_state_proxy.option_table import marked_section, with_section
from vllm_hidden_state_proxy.proxy import settings as proxy_settings
from vllm_hidden_state_proxy.worker_hook import settings as hook_settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
API_MD = DOCS / "api.md"
EXTRACT_MD = DOCS / "extract.md"
BENCHMARK_MD = DOCS / "benchmark.md"

#: Each marked section of a document, and the table it holds.
TABLES: dict[Path, dict[str, Callable[[], str]]] = {
    API_MD: {
        "serve-options-table": serve_options.options_table,
        "proxy-options-table": proxy_settings.options_table,
        "hook-environment-table": hook_settings.environment_table,
    },
    EXTRACT_MD: {"extract-options-table": extract_options.options_table},
    BENCHMARK_MD: {"bench-options-table": bench_options.options_table},
}


def rendered(document: str, tables: dict[str, Callable[[], str]]) -> str:
    """``document`` with every section of ``tables`` rendered anew."""
    for name, table in tables.items():
        document = with_section(document, name, table())
    return document


@pytest.mark.parametrize(
    ("path", "name"), [(path, name) for path, tables in TABLES.items() for name in sorted(tables)]
)
def test_the_docs_carry_the_table(path: Path, name: str) -> None:
    section = marked_section(path.read_text(encoding="utf-8"), name)
    assert section is not None, f"docs/{path.name} has no section {name}"
    assert section == TABLES[path][name](), (
        f"docs/{path.name}'s {name} differs from the code's: run `python -m tests.test_docs_tables`"
    )


if __name__ == "__main__":
    for path, tables in TABLES.items():
        path.write_text(rendered(path.read_text(encoding="utf-8"), tables), encoding="utf-8")
