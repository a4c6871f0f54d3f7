"""Hugging Face Transformers as the reference for every returned vector."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

#: Acceptance thresholds in float32 (issue #2).
MIN_COSINE = 0.9999
MAX_RELATIVE_L2 = 1e-3


class Reference:
    """The tiny model in Transformers: chat template, tokenizer and last hidden state."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def model(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        return model.eval()

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def chat_token_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the fully templated prompt, as vLLM builds it."""
        kwargs.setdefault("add_generation_prompt", True)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def last_hidden_state(self, token_ids: Sequence[int]) -> list[float]:
        """``model.model(ids).last_hidden_state[0, -1]``: final norm applied, position T-1."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = self.model.model(input_ids=ids).last_hidden_state[0, -1]
        return [float(x) for x in out.to(torch.float32)]

    @property
    def num_hidden_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def layer_vector(self, token_ids: Sequence[int], layer: int, pooling: str) -> list[float]:
        """``model.model(ids, output_hidden_states=True).hidden_states[layer][0]`` at the last
        position (``"last"``) or averaged over every position (``"mean"``, in float64)."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            states = self.model.model(input_ids=ids, output_hidden_states=True).hidden_states
        rows = states[layer][0].to(torch.float64)
        vector = rows[-1] if pooling == "last" else rows.mean(dim=0)
        return [float(x) for x in vector]

    def layer_rows(self, token_ids: Sequence[int], layer: int) -> list[list[float]]:
        """Every position's row of ``hidden_states[layer][0]``."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            states = self.model.model(input_ids=ids, output_hidden_states=True).hidden_states
        return [[float(x) for x in row] for row in states[layer][0].to(torch.float32)]

    def argmax_next_token(self, vector: Sequence[float]) -> int:
        import torch

        with torch.no_grad():
            logits = self.model.lm_head(torch.tensor(vector, dtype=torch.float32))
        return int(torch.argmax(logits))


def compare(actual: Sequence[float], expected: Sequence[float]) -> tuple[float, float]:
    """(cosine similarity, relative L2 error) of ``actual`` against ``expected``."""
    assert len(actual) == len(expected), f"length {len(actual)} != {len(expected)}"
    dot = sum(a * b for a, b in zip(actual, expected, strict=True))
    norm_a = math.sqrt(sum(a * a for a in actual))
    norm_e = math.sqrt(sum(e * e for e in expected))
    diff = math.sqrt(sum((a - e) ** 2 for a, e in zip(actual, expected, strict=True)))
    if norm_e == 0.0:  # e.g. layer 0 of the padding token, whose embedding is all zeros
        return (1.0, 0.0) if norm_a == 0.0 else (0.0, math.inf)
    if norm_a == 0.0:
        return 0.0, diff / norm_e
    return dot / (norm_a * norm_e), diff / norm_e


#: Every comparison made in this session, by kind of vector (layer and pooling): reported at
#: the end of the run (conftest).
MEASURED: dict[str, list[tuple[float, float]]] = {}
#: Counts a test measured beside its vectors (requests per engine...), one line each: reported
#: at the end of the run with the comparisons.
COUNTED: list[str] = []
#: The kind of the vector most tests check: ``last_hidden_state``.
FINAL_LAST = "layer -1, last"


def assert_matches(
    actual: Sequence[float], expected: Sequence[float], kind: str = FINAL_LAST
) -> tuple[float, float]:
    cosine, rel_l2 = compare(actual, expected)
    MEASURED.setdefault(kind, []).append((cosine, rel_l2))
    assert cosine >= MIN_COSINE and rel_l2 <= MAX_RELATIVE_L2, (
        f"vector differs from Transformers: cosine={cosine:.7f} rel_l2={rel_l2:.2e}"
    )
    return cosine, rel_l2
