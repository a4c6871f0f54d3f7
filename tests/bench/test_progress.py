"""Progress lines on stderr (bench/progress.py)."""

from __future__ import annotations

import io

from vllm_hidden_state_proxy.bench.progress import Progress


def test_a_task_says_every_tenth_and_how_long_it_took() -> None:
    stream = io.StringIO()
    task = Progress(stream).task("phase", 20)
    for _ in range(20):
        task.advance()
    task.done()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[bench] phase: 2/20 (10%)"
    assert len(lines) == 10  # nine tenths, then the final line
    assert lines[-1].startswith("[bench] phase: 20/20 in ") and lines[-1].endswith(" s")
