"""LangChain that keeps the vectors: :class:`HiddenStateChatOpenAI` and
:class:`HiddenStateEmbeddings` (the ``langchain`` extra: ``langchain-openai``).

``ChatOpenAI`` drops the answer's ``kv_transfer_params``. The subclass decodes them through the
client module into the message's ``response_metadata["hidden_states"]``: a dict from the
choice's index to its :class:`~vllm_hidden_state_proxy.client.HiddenStates`, for ``invoke``,
``ainvoke``, ``stream`` and ``astream``. Keyed by choice, streamed chunks merge into one dict
(LangChain concatenates lists and strings of chunks it adds up, which would join two choices'
vectors into one of double length); a prompt pooling gives every choice the prompt's entry.

``OpenAIEmbeddings`` by default tokenizes text with OpenAI's tiktoken and sends those ids, which
the proxy takes as this model's ids: wrong vectors, no error. :class:`HiddenStateEmbeddings`
always sends the text (``check_embedding_ctx_length`` is off and cannot be turned on), and
takes the proxy's extensions (``layer``, ``pooling``, ``normalize``, ``instruction``) as fields.
"""

from __future__ import annotations

from typing import Any

from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import model_validator

from vllm_hidden_state_proxy.client import (
    Dtype,
    HiddenStates,
    HiddenStateStream,
    read_hidden_states,
)
from vllm_hidden_state_proxy.protocol import BY_LAYER, DTYPE, KV, VECTOR, VECTORS

#: The ``response_metadata`` key of the decoded vectors: ``{choice index: HiddenStates}``.
METADATA_KEY = "hidden_states"


def _has_vectors(document: Any) -> bool:
    kv = document.get(KV) if isinstance(document, dict) else None
    return isinstance(kv, dict) and any(name in kv for name in (VECTOR, VECTORS, BY_LAYER))


def hidden_states_of(message: Any, choice: int = 0) -> HiddenStates:
    """The decoded vectors of ``message`` (an ``AIMessage`` or an added-up stream of chunks)
    for choice ``choice``; ``KeyError`` if it has none."""
    by_choice = message.response_metadata.get(METADATA_KEY) or {}
    if choice not in by_choice:
        raise KeyError(
            f"this message has no hidden states of choice {choice} (it has "
            f"{sorted(by_choice)}): was the request flagged (extra_body="
            "hidden_state_fields(...)), and is the model a HiddenStateChatOpenAI?"
        )
    states: HiddenStates = by_choice[choice]
    return states


class HiddenStateChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` whose messages keep the vectors (see the module docstring). Ask for
    them with ``extra_body=hidden_state_fields(...)``; read them with :func:`hidden_states_of`
    or ``message.response_metadata["hidden_states"]``."""

    def _hidden_state_dtype(self) -> Dtype | None:
        kv = (self.extra_body or {}).get(KV)
        dtype = kv.get(DTYPE) if isinstance(kv, dict) else None
        return dtype if dtype in ("float32", "float16", "bfloat16") else None

    def _create_chat_result(
        self, response: Any, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        document = response if isinstance(response, dict) else response.model_dump()
        if not _has_vectors(document):
            return result
        entries = read_hidden_states(document, dtype=self._hidden_state_dtype()).entries
        choices = document.get("choices") or []
        for position, generation in enumerate(result.generations):
            index = (
                choices[position].get("index", position) if position < len(choices) else position
            )
            entry = entries[0] if len(entries) == 1 else entries[index]
            generation.message.response_metadata[METADATA_KEY] = {index: entry}
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict[str, Any],
        default_chunk_class: type,
        base_generation_info: dict[str, Any] | None,
    ) -> ChatGenerationChunk | None:
        generation = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info
        )
        if generation is None or not _has_vectors(chunk):
            return generation
        entry = HiddenStateStream(dtype=self._hidden_state_dtype()).feed(chunk)
        choices = chunk.get("choices") or [{}]
        index = choices[0].get("index", 0)
        if entry is not None:
            generation.message.response_metadata[METADATA_KEY] = {index: entry}
        return generation


class HiddenStateEmbeddings(OpenAIEmbeddings):
    """``OpenAIEmbeddings`` for the proxy's ``/v1/embeddings``: always sends the text (never
    tiktoken's ids); ``layer``, ``pooling`` (``"last"``/``"mean"``), ``normalize`` and
    ``instruction`` are the proxy's extensions (the server's defaults when ``None``)."""

    check_embedding_ctx_length: bool = False
    layer: int | None = None
    pooling: str | None = None
    normalize: bool | None = None
    instruction: str | None = None

    @model_validator(mode="after")
    def _never_tiktoken(self) -> HiddenStateEmbeddings:
        if self.check_embedding_ctx_length:
            raise ValueError(
                "check_embedding_ctx_length=True would send OpenAI's tiktoken ids, which the "
                "proxy takes as this model's token ids (wrong vectors, no error): leave it off."
            )
        return self

    @property
    def _invocation_params(self) -> dict[str, Any]:
        params: dict[str, Any] = super()._invocation_params
        extensions = {
            "layer": self.layer,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "instruction": self.instruction,
        }
        extra = {name: value for name, value in extensions.items() if value is not None}
        if extra:
            params["extra_body"] = {**(params.get("extra_body") or {}), **extra}
        return params
