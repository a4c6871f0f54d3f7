"""``POST /v1/embeddings``: validate an OpenAI embeddings request and plan its vLLM requests.

Each input becomes one keyed one-token request to the chat model vLLM already serves:

- a text: the embedding template with ``{text}`` replaced is the user message of a chat request
  (thinking disabled);
- token ids: a raw ``/v1/completions`` prompt (no template);
- ``messages`` (vLLM's chat-form extension): that conversation as a chat request, with
  ``add_generation_prompt`` false unless the request says otherwise (as in vLLM's embeddings
  API), ``continue_final_message`` and ``chat_template_kwargs`` as given.

The vector is one layer's (``layer``, default the server's ``--embedding-layer``), pooled as
asked (``pooling``, default ``--embedding-pooling``). Pure functions: no I/O. Every error is a
400 naming its field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    FORMATS,
    PLACEHOLDER,
    PROMPT_POOLINGS,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request
from vllm_hidden_state_proxy.proxy.inspection import check_choice
from vllm_hidden_state_proxy.request_fields import VectorRequest, is_int, is_token_ids

_INPUT_TYPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


@dataclass(frozen=True)
class EmbeddingsPlan:
    """What to send to vLLM (path + body per input, in input order) and how to respond."""

    calls: list[tuple[str, dict[str, Any]]]
    encoding_format: str
    normalize: bool
    dimensions: int | None
    #: The one layer and the pooling every input's vector is taken with.
    vectors: VectorRequest
    #: The request field the inputs came from ("input" or "messages"), for error messages.
    field: str
    #: False when the layer is the server's default (``--embedding-layer``), not the request's.
    layer_given: bool = True


def _optional_bool(document: dict[str, Any], name: str, default: bool) -> bool:
    value = document.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", name)
    return value


def _inputs(value: Any) -> tuple[list[str], list[list[int]]]:
    """(texts, token-id prompts); exactly one of the two lists is non-empty."""
    if isinstance(value, str):
        if not value:
            raise bad_request("'input' must not be an empty string.", "input")
        return [value], []
    if not isinstance(value, list):
        raise bad_request(f"'input' must be {_INPUT_TYPES}.", "input")
    if not value:
        raise bad_request("'input' must not be an empty list.", "input")
    if is_token_ids(value):
        return [], [list(value)]
    if all(isinstance(t, str) for t in value):
        for index, text in enumerate(value):
            if not text:
                raise bad_request(f"'input[{index}]' must not be an empty string.", "input")
        return list(value), []
    if all(isinstance(t, list) for t in value):
        for index, ids in enumerate(value):
            if not is_token_ids(ids):
                raise bad_request(
                    f"'input[{index}]' must be a non-empty list of token ids.", "input"
                )
        return [], [list(ids) for ids in value]
    raise bad_request(f"'input' must be {_INPUT_TYPES} (not a mix).", "input")


#: Per form of request (``EmbeddingsPlan.field``), the client's fields that its calls carry to
#: vLLM as the client wrote them: the model, and the chat form's messages and options
#: (:func:`_messages_options`). Every other field of the calls is the proxy's own (a text
#: input's ``messages`` and ``chat_template_kwargs`` among them).
FORWARDED_FIELDS = {
    "messages": frozenset(
        {
            "model",
            "messages",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
        }
    ),
    "input": frozenset({"model"}),
}


def _chat_call(model: Any, messages: Any, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"messages": messages, "max_completion_tokens": 1, **options}
    if model is not None:
        body["model"] = model
    return CHAT_PATH, body


def _user_message(template: str, text: str) -> dict[str, str]:
    return {"role": "user", "content": template.replace(PLACEHOLDER, text)}


def _messages_options(document: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "add_generation_prompt": _optional_bool(document, "add_generation_prompt", False),
        "continue_final_message": _optional_bool(document, "continue_final_message", False),
    }
    kwargs = document.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad_request(
                "'chat_template_kwargs' must be a JSON object.", "chat_template_kwargs"
            )
        options["chat_template_kwargs"] = kwargs
    return options


@dataclass(frozen=True)
class EmbeddingsDefaults:
    """The server's side of an embeddings request."""

    template: str
    max_inputs: int
    layer: int = -1
    pooling: str = "last"


def _vectors(document: dict[str, Any], defaults: EmbeddingsDefaults) -> VectorRequest:
    """The layer and pooling asked for, or the server's defaults."""
    layer = document.get("layer")
    if layer is None:
        layer = defaults.layer
    elif not is_int(layer):
        raise bad_request(
            "'layer' must be an integer layer index (negative ones count from the end).", "layer"
        )
    pooling = document.get("pooling")
    pooling = (
        defaults.pooling if pooling is None else check_choice(pooling, "pooling", PROMPT_POOLINGS)
    )
    return VectorRequest(layers=(layer,), pooling=pooling)


def plan_embeddings(document: dict[str, Any], defaults: EmbeddingsDefaults) -> EmbeddingsPlan:
    """Validate ``document`` (an embeddings request) and plan its vLLM requests."""
    template, max_inputs = defaults.template, defaults.max_inputs
    encoding_format = check_choice(
        document.get("encoding_format") or "float", "encoding_format", FORMATS
    )
    vectors = _vectors(document, defaults)
    layer_given = document.get("layer") is not None
    normalize = _optional_bool(document, "normalize", True)
    dimensions = document.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or dimensions <= 0):
        raise bad_request("'dimensions' must be a positive integer.", "dimensions")
    instruction = document.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str) or PLACEHOLDER not in instruction:
            raise bad_request(
                f"'instruction' must be a prompt template string containing {PLACEHOLDER}.",
                "instruction",
            )
        template = instruction
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")

    has_input, has_messages = "input" in document, "messages" in document
    if has_input == has_messages:
        raise bad_request("Give exactly one of 'input' and 'messages'.", "input")
    if has_messages:
        messages = document["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of messages.", "messages")
        if instruction is not None:
            raise bad_request(
                "'instruction' applies to text inputs, not 'messages'.", "instruction"
            )
        calls = [_chat_call(model, messages, _messages_options(document))]
        return EmbeddingsPlan(
            calls, encoding_format, normalize, dimensions, vectors, "messages", layer_given
        )

    texts, token_prompts = _inputs(document["input"])
    count = len(texts) + len(token_prompts)
    if count > max_inputs:
        raise bad_request(
            f"'input' has {count} items; this server takes at most {max_inputs} per request.",
            "input",
        )
    if token_prompts and instruction is not None:
        raise bad_request("'instruction' applies to text inputs, not token ids.", "instruction")
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    calls = [_chat_call(model, [_user_message(template, text)], no_thinking) for text in texts]
    for ids in token_prompts:
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1}
        if model is not None:
            body["model"] = model
        calls.append((COMPLETIONS_PATH, body))
    return EmbeddingsPlan(
        calls, encoding_format, normalize, dimensions, vectors, "input", layer_given
    )


def dimensions_error(dimensions: int, hidden_size: int) -> ProxyError:
    return bad_request(
        f"'dimensions' {dimensions} is not supported: the embedding is one of the model's hidden "
        f"states, {hidden_size} values. Hidden states are not Matryoshka-trained, so a truncated "
        f"one is not a valid smaller embedding. Omit 'dimensions' or set it to {hidden_size}.",
        "dimensions",
    )
