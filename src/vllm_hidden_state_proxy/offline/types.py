"""The offline API's words: what a call returns, the error it raises, a prompt in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_hidden_state_proxy.client import HiddenStateAnswer, HiddenStateServerError


class HiddenStateOutput(NamedTuple):
    """One prompt's result: vLLM's ``RequestOutput`` and its hidden states (one entry, or one
    per choice for the answer poolings)."""

    output: Any
    states: HiddenStateAnswer


class OfflineHiddenStateError(HiddenStateServerError):
    """A prompt's hidden state cannot be had: ``index`` is the prompt's place in the call's
    input (``None``: none of them can), ``status`` what the server would answer."""

    def __init__(self, message: str, status: int, index: int | None = None) -> None:
        super().__init__(message, status)
        self.index = index


@dataclass
class InFlight:
    """One prompt added to the engine and not yet returned."""

    index: int
    prompt: Any
    request_id: str
    key: bytes
    num_prompt_tokens: int
    records: int
    arena: int
    #: The ring's publish counter when it was added (an overwrite is told from it).
    mark: int
    output: Any = None


def described(index: int, prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return f"prompt {index} ({text[:60]!r}{'...' if len(text) > 60 else ''})"
