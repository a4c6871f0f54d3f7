"""``POST /v1/completions``: like chat, and a flagged list of prompts gets one entry per prompt.

A list is sent to vLLM as one request (:mod:`..prompt_list`: the hook tells its prompts apart
by the engine ids vLLM gives them), except with the poolings that need every prompt position
(``"mean"``, spans, ``"all_prompt"``: their fresh ``cache_salt`` is one per request, so prompts
of one list sharing a prefix would hit each other's cache), with an answer's pooling and
``echo``, and for a list whose records would take more than a quarter of the smallest ring
(:func:`..prompt_list.why_not_one_request`). Those fan out: one upstream request per prompt,
each with its own key, at most ``settings.fan_out_limit`` in flight per client request, then
the replies merged the way vLLM would have (choices numbered in prompt order, usage summed).
If any prompt fails, the client gets that failure (the first in prompt order) and never a
partial list.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from starlette.types import Scope, Send

from vllm_hidden_state_proxy.protocol import FLAG, KV
from vllm_hidden_state_proxy.proxy.asgi import send_error
from vllm_hidden_state_proxy.proxy.endpoints import GenerationEndpoint, resolve_wanted
from vllm_hidden_state_proxy.proxy.errors import ProxyError, bad_request, completions_not_mergeable
from vllm_hidden_state_proxy.proxy.fan_out import Failed, fetch_all
from vllm_hidden_state_proxy.proxy.inspection import Flagged
from vllm_hidden_state_proxy.proxy.keyed_exchange import keyed_exchange
from vllm_hidden_state_proxy.proxy.planned_fields import COMPLETIONS_FIELDS
from vllm_hidden_state_proxy.proxy.prompt_list import prompt_list_exchange, why_not_one_request
from vllm_hidden_state_proxy.proxy.replies import send_joined, send_unchanged
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.fields import prompt_list_fields
from vllm_hidden_state_proxy.request_fields import is_token_ids
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

_PROMPT_TYPES = "a string, a list of token ids, or a list of strings or token-id lists"
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def prompt_list(document: dict[str, Any], limit: int) -> list[Any] | None:
    """The prompts of a flagged completions request if it has a list of them, ``None`` for a
    single prompt. Raises ``ProxyError`` 400 for shapes the flag cannot serve, and for a list
    of more than ``limit`` prompts."""
    prompt = document.get("prompt")
    embeds = document.get("prompt_embeds")
    single_embeds = not isinstance(embeds, list) or len(embeds) == 1
    if embeds is not None and (prompt is not None or not single_embeds):
        raise bad_request(
            f"{KV}.{FLAG} with 'prompt_embeds' needs exactly one prompt: send one per request.",
            "prompt_embeds",
        )
    if prompt is None or isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        raise bad_request(f"'prompt' must be {_PROMPT_TYPES}.", "prompt")
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt")
    if is_token_ids(prompt):
        return None
    if len(prompt) > limit:  # before any work per prompt
        raise bad_request(
            f"'prompt' is a list of {len(prompt)} prompts; with {KV}.{FLAG} at most {limit} are "
            "allowed per request (the proxy's --max-prompts): send the rest in further requests.",
            "prompt",
        )
    strings = isinstance(prompt[0], str)
    for index, item in enumerate(prompt):
        if not (isinstance(item, str) if strings else is_token_ids(item)):
            raise bad_request(  # vLLM takes a list of strings or a list of token-id lists
                f"'prompt[{index}]' must be a {'string' if strings else 'non-empty token-id list'}"
                f" like 'prompt[0]': {_PROMPT_TYPES}.",
                "prompt",
            )
    if document.get("stream") is True:
        raise bad_request(
            f"'stream': true with a list of prompts is not supported together with {KV}.{FLAG}: "
            "stream one prompt per request, or set 'stream': false.",
            "stream",
        )
    return list(prompt)


def merge_completions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One completions response from per-prompt ones, as vLLM builds it for a prompt list:
    the first part's id and metadata, choices renumbered in prompt order, usage summed."""
    merged = dict(parts[0])
    choices: list[Any] = []
    for part in parts:
        for choice in part.get("choices") or []:
            renumbered = {**choice, "index": len(choices)} if isinstance(choice, dict) else choice
            choices.append(renumbered)
    merged["choices"] = choices
    usages: list[dict[str, Any]] = [p["usage"] for p in parts if isinstance(p.get("usage"), dict)]
    if usages:
        usage = dict(usages[0])
        for name in _USAGE_COUNTS:
            if any(name in u for u in usages):
                usage[name] = sum(int(u.get(name) or 0) for u in usages)
        cached = [
            u["prompt_tokens_details"].get("cached_tokens")
            for u in usages
            if isinstance(u.get("prompt_tokens_details"), dict)
        ]
        if cached and all(isinstance(c, int) for c in cached):
            usage["prompt_tokens_details"] = {
                **usages[0]["prompt_tokens_details"],
                "cached_tokens": sum(cached),
            }
        merged["usage"] = usage
    if merged.get("metrics") is not None:  # per-request metrics describe one stream (vLLM)
        merged["metrics"] = None
    return merged


class CompletionsApp(GenerationEndpoint):
    planned_fields = COMPLETIONS_FIELDS

    def flagged_exchange(self, scope: Scope, send: Send, flagged: Flagged) -> Awaitable[None]:
        document = flagged.document
        prompts = prompt_list(document, self.state.settings.max_prompts)
        wanted = resolve_wanted(self.state, flagged)
        if prompts is None:
            return keyed_exchange(self.state, scope, send, document, wanted)
        slots = self.state.rings.smallest_slot_count()
        if why_not_one_request(document, wanted, len(prompts), slots) is None:
            return prompt_list_exchange(self.state, scope, send, document, wanted, prompts)
        return _prompt_list_exchange(self.state, scope, send, document, wanted, prompts)


async def _prompt_list_exchange(
    state: ProxyState,
    scope: Scope,
    send: Send,
    document: dict[str, Any],
    wanted: WantedVectors,
    prompts: list[Any],
) -> None:
    """Fan a flagged list of prompts out; respond with one entry per prompt, in prompt order."""
    jobs = [(scope, {**document, "prompt": prompt}) for prompt in prompts]
    replies = await fetch_all(state, jobs, wanted)
    if isinstance(replies, Failed):
        failure = replies.failure
        if isinstance(failure, ProxyError):
            await send_error(send, failure)
        else:  # vLLM's own error for that prompt
            await send_unchanged(send, failure.status, failure.headers, failure.content)
        return
    records = [record for reply in replies for record in reply.records]
    fields = prompt_list_fields(records, wanted)
    try:
        merged = merge_completions([reply.completion for reply in replies])
        await send_joined(send, replies[0].headers, merged, fields)
    except (TypeError, ValueError) as exc:  # not the completions shape vLLM writes
        await send_error(send, completions_not_mergeable(exc))
    except ProxyError as error:
        await send_error(send, error)
