"""LangChain that keeps the vectors: :class:`HiddenStateChatOpenAI` and
:class:`HiddenStateEmbeddings` (the ``langchain`` extra: ``langchain-openai``).

``ChatOpenAI`` drops the answer's ``kv_transfer_params``. The subclass decodes them through the
client module into the message's ``response_metadata["hidden_states"]``: a dict from the
choice's index to its :class:`~vllm_hidden_state_proxy.client.HiddenStates`, for ``invoke``,
``ainvoke``, ``stream`` and ``astream``. Keyed by choice, streamed chunks merge into one dict
(LangChain concatenates lists and strings of chunks it adds up, which would join two choices'
vectors into one of double length); a prompt pooling gives every choice the prompt's entry
(in a stream the proxy sends it once, on the first chunk with a choice: that chunk gets it for
each of the request's ``n`` choices). Base64 values are read in the dtype the answer says
(the proxy writes ``last_hidden_state_dtype`` beside 16-bit ones), so a per-call
``extra_body`` asking for bfloat16 reads as right as one given to the constructor.

Entries are merged by choice, never by comparing arrays (:class:`HiddenStates` compare by
identity): a stream whose chunks carry a choice's vectors twice, or vectors for a choice the
request did not ask for, raises :class:`~vllm_hidden_state_proxy.client.HiddenStateDecodeError`,
and so does a JSON answer whose entries do not match its choices (one entry of an answer pooling
for two choices, a choice index that is not one of them); vLLM's error chunk
(``{"object": "error", ...}``) raises
:class:`~vllm_hidden_state_proxy.client.HiddenStateServerError`.

``OpenAIEmbeddings`` by default tokenizes text with OpenAI's tiktoken and sends those ids, which
the proxy takes as this model's ids: wrong vectors, no error. :class:`HiddenStateEmbeddings`
always sends the text (``check_embedding_ctx_length`` is off and cannot be turned on), and
takes the proxy's extensions (``layer``, ``pooling``, ``normalize``, ``instruction``) as fields.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import model_validator

from vllm_hidden_state_proxy.client import (
    HiddenStateDecodeError,
    HiddenStates,
    HiddenStateStream,
    read_hidden_states,
)
from vllm_hidden_state_proxy.client.answers import is_per_entry, server_error
from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    BY_LAYER,
    KV,
    POOLING,
    VECTOR,
    VECTORS,
)
from vllm_hidden_state_proxy.request_fields import is_int

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

    def _stream_choices(self, call: dict[str, Any]) -> _StreamChoices:
        """What a stream's entries may be: one per choice of the request's ``n``, or with a
        prompt pooling one for all (on the stream's first chunk with a choice). ``call``: this
        call's keyword arguments, which LangChain lays over the model's own (``n``,
        ``extra_body``) to build the request."""
        params = {**self._default_params, **call}
        extra_body = params.get("extra_body")
        kv = extra_body.get(KV) if isinstance(extra_body, dict) else None
        answer_pooling = isinstance(kv, dict) and kv.get(POOLING) in ANSWER_POOLINGS
        n = params.get("n")
        return _StreamChoices(n if is_int(n) and n > 1 else 1, not answer_pooling)

    def _stream(self, *args: Any, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        choices = self._stream_choices(kwargs)
        for generation in super()._stream(*args, **kwargs):
            yield choices.checked(generation)

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        choices = self._stream_choices(kwargs)
        async for generation in super()._astream(*args, **kwargs):
            yield choices.checked(generation)

    def _create_chat_result(
        self, response: Any, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        document = response if isinstance(response, dict) else response.model_dump()
        if not _has_vectors(document):
            return result
        entries = read_hidden_states(document).entries
        count = len(result.generations)
        indices = _choice_indices(document.get("choices"), count)
        if is_per_entry(document[KV]):  # one entry per choice
            if len(entries) != count:
                raise HiddenStateDecodeError(
                    f"the answer carries {len(entries)} entries of hidden states for {count} "
                    "choices: one each was expected"
                )
        else:  # the prompt's entry, every choice's (or an answer pooling's one choice)
            info = entries[0].info or {}
            if info.get("pooling") in ANSWER_POOLINGS and count > 1:
                raise HiddenStateDecodeError(
                    f"the answer carries one entry of {info['pooling']} for {count} choices: "
                    "one each was expected"
                )
            entries = (entries[0],) * count
        for generation, index in zip(result.generations, indices, strict=True):
            generation.message.response_metadata[METADATA_KEY] = {index: entries[index]}
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict[str, Any],
        default_chunk_class: type,
        base_generation_info: dict[str, Any] | None,
    ) -> ChatGenerationChunk | None:
        error = server_error(chunk)  # vLLM's {"object": "error"}: the SDK lets it through
        if error is not None:
            raise error
        generation = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info
        )
        if generation is None or not _has_vectors(chunk):
            return generation
        entry = HiddenStateStream().feed(chunk)  # checks the choice's index
        choices = chunk.get("choices") or [{}]
        index = choices[0].get("index", 0)
        if entry is not None:
            generation.message.response_metadata[METADATA_KEY] = {index: entry}
        return generation


def _choice_indices(choices: Any, count: int) -> list[int]:
    """The ``count`` choices' indices: 0 to ``count - 1``, each once (in any order)."""
    if not isinstance(choices, list) or len(choices) != count:
        raise HiddenStateDecodeError(f"the answer's choices are not a list of {count}")
    indices: list[int] = []
    for position, choice in enumerate(choices):
        index = choice.get("index", position) if isinstance(choice, dict) else None
        if not (is_int(index) and 0 <= index < count) or index in indices:
            raise HiddenStateDecodeError(
                f"choices[{position}].index is {index!r}: not one of the answer's {count} "
                "choices, each once"
            )
        indices.append(index)
    return indices


class _StreamChoices:
    """One stream's entries, as its chunks come: each choice's at most once and within the
    request's ``n``; with a prompt pooling, the one entry given to every choice."""

    def __init__(self, n: int, shared: bool) -> None:
        self.n = n
        self.shared = shared
        self.seen: set[int] = set()

    def checked(self, generation: ChatGenerationChunk) -> ChatGenerationChunk:
        by_choice = generation.message.response_metadata.get(METADATA_KEY)
        if not by_choice:
            return generation
        [(index, entry)] = by_choice.items()  # one chunk, one choice
        if index >= self.n:
            raise HiddenStateDecodeError(
                f"a chunk of the stream carries hidden states for choice {index}, but the "
                f"request asked for {self.n} choice{'s' if self.n > 1 else ''}"
            )
        indices = range(self.n) if self.shared else (index,)
        for choice in indices:
            if choice in self.seen:
                raise HiddenStateDecodeError(
                    f"choice {choice}'s hidden states came twice in the stream"
                )
        self.seen.update(indices)
        if self.shared and self.n > 1:
            generation.message.response_metadata[METADATA_KEY] = dict.fromkeys(indices, entry)
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
