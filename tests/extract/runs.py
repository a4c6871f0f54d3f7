"""Running ``extract`` in a test: a corpus written, the options, the run against a fake (or a
transport of several), and what it left: the parts' table, the errors file, the manifest."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from tests.extract.fake_proxy import FakeProxy
from vllm_hidden_state_proxy.extract.options import ExtractOptions
from vllm_hidden_state_proxy.extract.runner import run_extract

URL = "http://fake"


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def options(output: Path | str, **changes: Any) -> ExtractOptions:
    return replace(ExtractOptions(urls=(URL,), output=str(output)), **changes)


def run(
    inputs: Path | str, opts: ExtractOptions, fake: FakeProxy | httpx.AsyncBaseTransport | None
) -> tuple[int, str]:
    """``extract`` against the fake (or a transport; ``None``: its own, over the network)."""
    stderr = io.StringIO()
    transport = fake.transport() if isinstance(fake, FakeProxy) else fake
    status = run_extract(inputs, opts, command_line=["test"], transport=transport, stderr=stderr)
    return status, stderr.getvalue()


def table(output: Path) -> pa.Table:
    return pq.read_table(sorted(output.glob("part-*.parquet")))


def errors(output: Path) -> list[dict[str, Any]]:
    lines = (output / "_errors.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def manifest(output: Path) -> dict[str, Any]:
    return dict(json.loads((output / "_manifest.json").read_text(encoding="utf-8")))


def corpus(count: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for i in range(count):
        if i % 2:
            records.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"chat {i}"}]})
        else:
            records.append({"id": i, "prompt": f"text {i}"})
    return records
