"""What many e2e tests send: chat without the tiny models' thinking, and ordinary traffic
running beside flagged requests."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

#: The Qwen3-style template's switch: the answer starts at once (no ``<think>`` block).
NO_THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}

T = TypeVar("T")


def beside_ordinary_traffic(
    client: Any, model: str, flagged: Callable[[int], T], count: int, ordinary: int = 8
) -> list[T]:
    """``flagged(0..count-1)`` and ``ordinary`` plain chats, all at once on 8 threads; every
    ordinary chat must get an answer. The flagged results, in order."""

    def plain(i: int) -> str | None:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Ordinary {i}"}],
            max_completion_tokens=4,
            extra_body=NO_THINKING,
        )
        content: str | None = response.choices[0].message.content
        return content

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        answers = [pool.submit(flagged, i) for i in range(count)]
        others = [pool.submit(plain, i) for i in range(ordinary)]
        assert all(isinstance(other.result(), str) for other in others)
        return [answer.result() for answer in answers]
