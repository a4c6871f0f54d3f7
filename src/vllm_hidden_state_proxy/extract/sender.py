"""A batch's requests: sent to the proxy with the fewest inputs in flight, retried after 429,
503, 504, a connection error or a timeout (with backoff), and each input's result: its rows or
its failure.

A batch that fails otherwise (a 4xx, an answer that does not hold one choice and one vector per
input, or gives a token-id prompt an entry of another length: ``rows.batch_rows``, a body or an
answer too long) is split in halves and each half sent
again, down to single inputs sent alone: one bad input fails only itself, after about
``log2(batch)`` more requests. A batch whose retries ran out fails whole (the server is busy
or gone, not an input). Chats go through ``/v1/chat/completions/batch``; a proxy that answers
it 404 or 405, or 400 to a batch whose chats then all pass alone (a proxy that refuses the
flag on that path), is remembered as one without it, and its chats go one a request.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from vllm_hidden_state_proxy.extract.batches import CHAT_BATCH, CHATS, BodyMaker, Item
from vllm_hidden_state_proxy.extract.exchange import Refused, exchange
from vllm_hidden_state_proxy.extract.progress import Counts
from vllm_hidden_state_proxy.extract.proxies import Proxy
from vllm_hidden_state_proxy.extract.rows import answer_rows, batch_rows

#: Answers worth another try: the server is busy or a vector came late, not the input's fault.
RETRIED_STATUSES = frozenset({429, 503, 504})
BACKOFF_FIRST = 0.5
BACKOFF_MOST = 30.0
#: What a proxy without the chat batch route answers it (no route; a method not allowed).
_NO_ROUTE = frozenset({404, 405})

Rows = list[dict[str, Any]]
#: One input's result: its rows, or why it failed.
Result = tuple[Item, Rows | Refused]


class GaveUp(Refused):
    """Retries ran out (busy, timeouts, connections): no input's fault, the batch fails whole."""


class _NoChatBatches(Exception):
    """The proxy does not serve the chat batch route: send the chats one a request."""


class _UnprovenRefusal(Exception):
    """A 400 to a chat batch from a proxy not yet seen to serve the route."""

    def __init__(self, refused: Refused, proxy: Proxy) -> None:
        super().__init__(refused.reason)
        self.refused = refused
        self.proxy = proxy


class Sender:
    """Sends batches for one run (see the module docstring)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        proxies: list[Proxy],
        plan: dict[str, Any],
        bodies: BodyMaker,
        counts: Counts,
        *,
        body_limit: int,
        answer_limit: Callable[[int], int],
        retries: int,
        timeout: float,
        sleep: Callable[[float], Any],
    ) -> None:
        self.client = client
        self.proxies = proxies
        self.plan = plan
        self.bodies = bodies
        self.counts = counts
        self.body_limit = body_limit
        self.answer_limit = answer_limit
        self.retries = retries
        self.timeout = timeout
        self.sleep = sleep
        self._turn = 0

    def _pick(self) -> Proxy:
        """The proxy with the fewest in flight; ties in turn."""
        proxies = self.proxies
        self._turn += 1
        start = self._turn % len(proxies)
        ordered = proxies[start:] + proxies[:start]
        return min(ordered, key=lambda p: p.in_flight / p.limit)

    async def send(self, items: Sequence[Item]) -> list[Result]:
        """Each input's result (see the module docstring)."""
        items = list(items)
        if items[0].refused is not None:
            return [(items[0], items[0].refused)]
        try:
            return list(zip(items, await self._request(items), strict=True))
        except GaveUp as gave_up:
            return [(item, gave_up) for item in items]
        except _NoChatBatches:
            return await self._alone(items)
        except _UnprovenRefusal as unproven:
            results = await self._alone(items)
            if all(not isinstance(result, Refused) for _, result in results):
                unproven.proxy.chat_batches = False
            return results
        except Refused as refused:
            if len(items) == 1:
                return [(items[0], refused)]
        half = len(items) // 2
        first, second = await asyncio.gather(self.send(items[:half]), self.send(items[half:]))
        return first + second

    async def _alone(self, items: list[Item]) -> list[Result]:
        results = await asyncio.gather(*(self.send([item]) for item in items))
        return [result for one in results for result in one]

    async def _request(self, items: list[Item]) -> list[Rows]:
        """One request for ``items`` and its rows by input, retried as the module says."""
        path, content = self.bodies.body(items)
        if len(content) > self.body_limit:
            raise Refused(
                f"the request body is {len(content)} bytes, more than the proxies take "
                f"(max_body_bytes {self.body_limit}: serve --max-body-size)",
                None,
            )
        batch = len(items) > 1
        chats = batch and items[0].kind == CHATS
        attempt = 0
        timeout = self.timeout
        while True:
            proxy = self._pick()
            if chats and proxy.chat_batches is False:
                raise _NoChatBatches
            proxy.in_flight += len(items)
            wait: float | None = None
            try:
                answer = await exchange(
                    self.client,
                    proxy.url + path,
                    content,
                    max_bytes=self.answer_limit(len(items)),
                    timeout=timeout,
                )
            except TimeoutError:
                status, cause = None, "timeout"
                reason = f"{proxy.url}: no whole answer within --timeout {timeout:g} s"
            except httpx.TimeoutException as exc:
                status, cause, reason = None, "timeout", f"{proxy.url}: {type(exc).__name__}: {exc}"
            except httpx.TransportError as exc:
                status, cause = None, "connection"
                reason = f"{proxy.url}: {type(exc).__name__}: {exc}"
            else:
                status = answer.status
                if status == 200:
                    if not batch:
                        return [answer_rows(items[0].input.id, answer.body, self.plan)]
                    rows = batch_rows(
                        [item.input.id for item in items],
                        answer.body,
                        self.plan,
                        [item.prompt_tokens for item in items],
                    )
                    if chats:
                        proxy.chat_batches = True
                    return rows
                reason, cause, wait = (
                    answer.error_reason(),
                    answer.retry_cause(),
                    answer.retry_after(),
                )
            finally:
                proxy.in_flight -= len(items)
            if status is not None and status not in RETRIED_STATUSES:
                if chats and path == CHAT_BATCH and status in _NO_ROUTE:
                    proxy.chat_batches = False
                    raise _NoChatBatches
                if chats and status == 400 and proxy.chat_batches is None:
                    raise _UnprovenRefusal(Refused(reason, status), proxy)
                raise Refused(reason, status)
            if attempt >= self.retries:
                raise GaveUp(f"{reason} (after {attempt} retries)", status)
            backoff = min(BACKOFF_MOST, BACKOFF_FIRST * 2**attempt) * random.uniform(0.5, 1.0)
            attempt += 1
            self.counts.retried(cause)
            await self.sleep(backoff if wait is None else min(wait, BACKOFF_MOST))
