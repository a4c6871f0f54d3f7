"""The mark of a response stream whose ``aclose`` never suspends (both engines' streams).

A client disconnect cancels the task that relays vLLM's response; a close that cannot suspend
cannot be interrupted by that cancel, so it needs no shielding
(:func:`~vllm_hidden_state_proxy.transport.close_quietly`)."""

from __future__ import annotations

import httpx


class ClosesAtOnce(httpx.AsyncByteStream):
    """A response stream whose ``aclose`` never suspends (so nothing can interrupt it)."""
