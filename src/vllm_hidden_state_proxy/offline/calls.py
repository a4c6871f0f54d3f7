"""The calls: ``generate``, ``chat`` (and their ``iter_`` forms) and ``embed``, shaped as
``LLM``'s own: the same arguments, plus the server's vector options, checked by its rules."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from vllm_hidden_state_proxy.client import HiddenStateRequestError
from vllm_hidden_state_proxy.client.types import Array, Dtype, Pooling
from vllm_hidden_state_proxy.offline.engine_loop import Item, run
from vllm_hidden_state_proxy.offline.engine_ring import check_vllm
from vllm_hidden_state_proxy.offline.types import HiddenStateOutput
from vllm_hidden_state_proxy.protocol import (
    DEFAULT_TEMPLATE,
    DTYPE,
    FLAG,
    FORMAT,
    KV,
    LAYERS,
    PLACEHOLDER,
    POOLING,
    PROMPT_POOLINGS,
    SPANS,
)
from vllm_hidden_state_proxy.request_fields import RequestFieldError, VectorRequest, vector_request

#: The server's field names in the shared rules' messages, and the arguments they are here.
_OPTION_NAMES = {
    f"{KV}.{LAYERS}": "layers",
    f"{KV}.{POOLING}": "pooling",
    f"{KV}.{SPANS}": "spans",
    f"{KV}.{DTYPE}": "dtype",
}


def iter_generate(
    llm: Any,
    prompts: Any,
    sampling_params: Any = None,
    *,
    layers: Sequence[int] | None = None,
    pooling: Pooling | None = None,
    spans: Sequence[Sequence[int]] | None = None,
    dtype: Dtype = "float32",
    use_tqdm: bool | Callable[..., Any] = True,
    lora_request: Any = None,
    priority: int | Sequence[int] | None = None,
    tokenization_kwargs: dict[str, Any] | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> Generator[HiddenStateOutput, None, None]:
    """As ``llm.generate(prompts, sampling_params, ...)``, one result at a time, in input order,
    with each prompt's hidden states. ``prompts``: one prompt (a string, a ``TextPrompt`` or
    ``TokensPrompt`` dict, multimodal data included) or any iterable of them, read lazily.
    ``layers``, ``pooling``, ``spans``, ``dtype``: as the server's fields
    (``last_hidden_state_*``, docs/api.md); 16-bit dtypes give float32 arrays of the rounded
    values."""
    request = _vector_request(layers, pooling, spans, dtype)
    check_vllm(llm)

    def render(prompt: Any) -> Any:
        if _is_token_ids(prompt):
            prompt = {"prompt_token_ids": list(prompt)}
        return llm._preprocess_cmpl_one(
            prompt, tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs
        )

    items = _items(_prompt_seq(prompts), sampling_params, lora_request, priority, llm)
    return run(llm, items, render, request, use_tqdm, _length(prompts))


def generate(llm: Any, prompts: Any, sampling_params: Any = None, **options: Any) -> list[Any]:
    """:func:`iter_generate`, all at once: a list of :class:`HiddenStateOutput`."""
    return list(iter_generate(llm, prompts, sampling_params, **options))


def iter_chat(
    llm: Any,
    messages: Any,
    sampling_params: Any = None,
    *,
    layers: Sequence[int] | None = None,
    pooling: Pooling | None = None,
    spans: Sequence[Sequence[int]] | None = None,
    dtype: Dtype = "float32",
    use_tqdm: bool | Callable[..., Any] = True,
    lora_request: Any = None,
    priority: int | Sequence[int] | None = None,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tokenization_kwargs: dict[str, Any] | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> Generator[HiddenStateOutput, None, None]:
    """As ``llm.chat(messages, sampling_params, ...)``, one result at a time, in input order,
    with each conversation's hidden states (:func:`iter_generate` for the vector options).
    ``messages``: one conversation (a list of messages) or an iterable of them."""
    request = _vector_request(layers, pooling, spans, dtype)
    check_vllm(llm)

    def render(conversation: Any) -> Any:
        return llm._preprocess_chat_one(
            conversation,
            chat_template=chat_template,
            chat_template_content_format=chat_template_content_format,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            tokenization_kwargs=tokenization_kwargs,
            mm_processor_kwargs=mm_processor_kwargs,
        )

    conversations = _conversation_seq(messages)
    items = _items(conversations, sampling_params, lora_request, priority, llm)
    return run(llm, items, render, request, use_tqdm, _length(messages, conversation=True))


def chat(llm: Any, messages: Any, sampling_params: Any = None, **options: Any) -> list[Any]:
    """:func:`iter_chat`, all at once: a list of :class:`HiddenStateOutput`."""
    return list(iter_chat(llm, messages, sampling_params, **options))


def embed(
    llm: Any,
    inputs: Iterable[str | Sequence[int]],
    *,
    layer: int = -1,
    pooling: str = "last",
    template: str | None = DEFAULT_TEMPLATE,
    normalize: bool = True,
    dtype: Dtype = "float32",
    use_tqdm: bool | Callable[..., Any] = True,
) -> Array:
    """One vector per input, as the server's ``/v1/embeddings``: an array ``(inputs,
    hidden_size)``. A text goes into ``template`` as the user message of a chat (thinking off;
    ``template=None``: the text itself as a plain prompt, as vLLM's pooling runner takes it);
    token ids are a plain prompt. ``layer`` (one the engine captures) and ``pooling``
    (``"last"`` or ``"mean"``) as the server's; ``normalize``: to unit length."""
    if pooling not in PROMPT_POOLINGS:
        raise HiddenStateRequestError(
            f"'pooling' must be one of {', '.join(PROMPT_POOLINGS)}, not {pooling!r}.", "pooling"
        )
    if template is not None and PLACEHOLDER not in template:
        raise HiddenStateRequestError(f"'template' must contain {PLACEHOLDER}.", "template")
    request = _vector_request([layer], pooling, None, dtype)
    check_vllm(llm)
    from vllm import SamplingParams

    def render(item: str | Sequence[int]) -> Any:
        if isinstance(item, str) and template is not None:
            message = {"role": "user", "content": template.replace(PLACEHOLDER, item)}
            return llm._preprocess_chat_one(
                [message], chat_template_kwargs={"enable_thinking": False}
            )
        prompt = item if isinstance(item, str) else {"prompt_token_ids": list(item)}
        return llm._preprocess_cmpl_one(prompt)

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    items = _items(iter(inputs), params, None, None, llm)
    rows = [
        states.single.layer(layer)
        for _, states in run(llm, items, render, request, use_tqdm, _length(inputs))
    ]
    hidden = int(llm.llm_engine.vllm_config.model_config.get_hidden_size())
    vectors = np.stack(rows) if rows else np.zeros((0, hidden), np.float32)
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms == 0, 1, norms)
    return vectors.astype(np.float32, copy=False)


def _vector_request(
    layers: Sequence[int] | None, pooling: str | None, spans: Any, dtype: str
) -> VectorRequest:
    """The options, checked by the server's own rules (``request_fields.py``); errors name the
    argument."""
    asked: dict[str, Any] = {FLAG: True, FORMAT: "base64", DTYPE: dtype}
    for name, value in ((LAYERS, layers), (POOLING, pooling), (SPANS, spans)):
        if value is not None:
            asked[name] = value
    try:
        return vector_request(asked)[1]
    except RequestFieldError as refused:
        message, param = refused.message, refused.param
        for field, name in _OPTION_NAMES.items():
            message = message.replace(field, name)
        raise HiddenStateRequestError(message, _OPTION_NAMES.get(param, param)) from None


def _items(
    prompts: Iterator[Any], sampling_params: Any, lora: Any, priority: Any, llm: Any
) -> Iterator[Item]:
    """(prompt, its SamplingParams, LoRA request, priority), as ``LLM.generate`` pairs them."""
    if sampling_params is None:
        sampling_params = llm.get_default_sampling_params()
    for index, prompt in enumerate(prompts):
        yield (
            prompt,
            _nth(sampling_params, index, "sampling_params"),
            _nth(lora, index, "lora_request"),
            _nth(priority, index, "priority") or 0,
        )


def _nth(value: Any, index: int, name: str) -> Any:
    if not isinstance(value, Sequence) or isinstance(value, str):
        return value
    if index >= len(value):
        raise HiddenStateRequestError(f"'{name}' has fewer entries than the prompts.", name)
    return value[index]


def _prompt_seq(prompts: Any) -> Iterator[Any]:
    """One prompt (a string, a prompt dict, token ids) as a sequence of one; else the
    iterable's own."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return iter([prompts])
    return iter(prompts)


def _conversation_seq(messages: Any) -> Iterator[Any]:
    if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
        return iter([messages])  # one conversation
    return iter(messages)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


def _length(values: Any, conversation: bool = False) -> int | None:
    if isinstance(values, (str, Mapping)) or _is_token_ids(values):
        return 1
    if conversation and isinstance(values, Sequence) and values:
        return 1 if isinstance(values[0], Mapping) else len(values)
    return len(values) if isinstance(values, Sequence) else None
