"""Connection faults (issue #7): clients that go away, a vLLM that is too slow, slow readers.

- A client that disconnects mid-request (flagged or not, streamed or not, an embeddings
  fan-out) gets its vLLM request aborted: vLLM never completes it, stops generating for it and
  has nothing running or waiting a moment later; the proxy keeps no extra connections to vLLM
  and no extra memory.
- A proxy with a short read timeout answers an OpenAI-shaped 504, promptly, when vLLM stops
  answering in the middle of a long generation, and vLLM's request is aborted; short requests
  and a stream that keeps producing are not cut by it.
- Clients that read a long stream slowly, or not at all for a while, stall nobody else.

Timing on this 2-core machine: while vLLM generates, other processes can wait seconds for the
CPU (a 0.5 s httpx read timeout, no proxy involved, measured firing up to 2.7 s late, and once
not within 8 s) and vLLM's own /metrics can take 4 s to answer. So the long generations here
take 7-13 s (32 choices of 900 tokens with top-5 logprobs), time limits are generous, and what
is asserted is the outcome, from vLLM's counters once it is idle.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import RunningStack
from tests.e2e.stack_probe import (
    MIB,
    Progress,
    connections_to,
    hang_ups_pending,
    port_of,
    progress,
    proxy_process,
    queue_bytes,
    raw_post,
    read_http_response,
    read_until,
    readable,
    ring_publishes,
    rss,
    vllm_engine_frozen,
    vllm_engine_yielding,
    vllm_processes,
    wait_idle,
    wait_until,
)
from vllm_hidden_state_proxy.processes import free_port
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

FLAG = {"return_last_hidden_state": True}
#: Tokens per choice of a long generation (the context is 1024 tokens).
LONG = 900
#: Choices and logprobs that make a long generation last 7-13 s (alone: 900 tokens take about
#: 2 s) and, streamed, about 11 MB: more than the kernel buffers between a client that
#: does not read and the proxy, and between the proxy and vLLM.
SLOW = {"n": 32, "logprobs": True, "top_logprobs": 5}
FULL = LONG * int(SLOW["n"])
#: A safety net, not a timing: how long a request may take to reach vLLM on a loaded machine.
STARTED_WITHIN = 120.0
#: A safety net, not a timing: how long vLLM may take, once the client is gone, to have nothing
#: running or waiting on a loaded machine.
ABORT_WITHIN = 60.0
#: A leak grows the proxy's RSS every round; the allocator's high water rises in steps (a new
#: arena, a generation that got further before its hang-up than any before it: 14 MiB once, in
#: one round of five, on a fresh clone's CI). So the quietest round after the warm-up must grow
#: less than this, and all of them together less than ``MAX_RSS_GROWTH``.
MAX_RSS_GROWTH_QUIET_ROUND = 1 * MIB
MAX_RSS_GROWTH = 48 * MIB


def chat_body(
    model: str, text: str, *, flagged: bool, stream: bool, tokens: int, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_completion_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
        **NO_THINKING,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if flagged:
        body["kv_transfer_params"] = FLAG
    return body


def long_body(model: str, text: str, *, flagged: bool, stream: bool) -> dict[str, Any]:
    """``FULL`` tokens (``LONG`` for each of ``SLOW["n"]`` choices), 7-13 s of work."""
    return chat_body(model, text, flagged=flagged, stream=stream, tokens=LONG, **SLOW)


def check_complete_stream(text: str, tokens: int) -> list[dict[str, Any]]:
    """The chunks of a complete chat stream with usage; checks [DONE] and the token count."""
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens
    return chunks


def short_text(response: httpx.Response) -> str:
    return f"{response.status_code} {response.text[:500]}"


# --- client disconnects ---------------------------------------------------------------------

DISCONNECTS = ("flagged", "ordinary", "flagged_stream", "ordinary_stream", "embeddings_fan_out")
FAN_OUT_INPUTS = 2048


class MissedWindow(Exception):
    """vLLM was seen working on the request late in it (or after it) when the client was about
    to hang up: hanging up then proves nothing about the proxy, so the attempt is made again."""


#: Attempts at catching vLLM early in a request (see ``seen_early`` and ``hang_up``).
ATTEMPTS = 5


#: The share of a long generation that must be left when the engine is frozen: the hang-up's
#: abort is queued for the engine before it goes on (``hang_up``), and it reads it within a
#: step or two; 10% is 90 steps.
LEFT_AT_FREEZE = 0.1


def too_late(now: Progress, before: Progress) -> bool:
    """vLLM finished a request since ``before``, or nearly all of a long one."""
    generated = now.generated - before.generated
    return now.finished > before.finished or generated >= FULL * (1 - LEFT_AT_FREEZE)


def seen_early(stack: RunningStack, before: Progress, *, generating: bool = False) -> bool:
    """vLLM works on the request sent after ``before`` (with ``generating``: its API server has
    taken in a token of it) and is not ``too_late`` in it.

    vLLM's /metrics can take seconds to answer while it generates, so the look may arrive
    late: one that shows the request done, or nearly done (``too_late``), raises
    ``MissedWindow``. The engine is frozen before the hang-up (``hang_up``), so what is left
    of the request only has to outlast the engine's reading of its abort.
    """
    now = progress(stack)
    if too_late(now, before):
        raise MissedWindow(f"first seen at {now.generated - before.generated:g} of {FULL} tokens")
    if generating:
        return now.generated > before.generated
    return now.in_flight >= 1


#: A safety net, not a timing: how long a loaded machine may take to pass a hang-up along.
HANG_UP_WITHIN = 60.0


def settled_progress(stack: RunningStack) -> Progress:
    """vLLM's counters once its API server has taken in every output the (frozen) engine sent:
    two looks in a row agree."""
    look = progress(stack)
    for _ in range(1000):
        again = progress(stack)
        if again == look:
            return look
        look = again
    raise AssertionError(f"vLLM's counters kept moving with its engine frozen: {look}")


def hang_up(stack: RunningStack, sock: socket.socket, kind: str, before: Progress) -> None:
    """Close ``sock`` while vLLM's engine stands still, and let the engine go on once the hang-up
    has reached vLLM's API server (the proxy dropped its connection to vLLM, and the server
    closed its end, which sends the engine an abort): however slowly a loaded machine passes
    the hang-up along, the request cannot finish in between. States, not times.

    Raises ``MissedWindow`` (the socket closed, the engine let go) if the engine was already
    ``too_late`` in the request when it was stopped: a loaded machine's engine can
    run far ahead of the outputs its API server and the proxy have passed on.
    """
    proxy, port = proxy_process(stack), port_of(stack.vllm_url)
    server = vllm_processes(stack)[0]
    with vllm_engine_frozen(stack):
        look = settled_progress(stack)
        finished, generated = look.finished - before.finished, look.generated - before.generated
        if kind == "embeddings_fan_out":
            late = finished >= FAN_OUT_INPUTS / 2
        else:
            late = too_late(look, before)
        if late:
            sock.close()
            raise MissedWindow(f"stopped after {finished:g} requests, {generated:g} tokens")
        if kind.endswith("stream"):
            # The API server took in a token before the freeze (``seen_early``), so the
            # stream's first event reaches the client with the engine standing still.
            sock.settimeout(STARTED_WITHIN)
            head = read_until(sock, b"data: ")
            assert head.startswith(b"HTTP/1.1 200") and b"data: " in head, head[:300]
        busy = connections_to(proxy, port)
        sock.close()
        dropped = wait_until(lambda: connections_to(proxy, port) < busy, HANG_UP_WITHIN)
        assert dropped is not None, "the proxy kept its connection to vLLM after the hang-up"
        noticed = wait_until(lambda: hang_ups_pending(server, port) == 0, HANG_UP_WITHIN)
        assert noticed is not None, "vLLM's API server never noticed the proxy hang up"


def disconnect_once(stack: RunningStack, model: str, kind: str, round_: int) -> Progress:
    """Send one request of ``kind`` and hang up while vLLM works on it; returns vLLM's
    counters from just before the request that was hung up on.

    "Works on it" is a state, not a time: a stream's first token reached vLLM's API server
    (its first event then reaches the client while the engine is frozen); a flagged
    request's (or an embeddings input's) record was published, at its prefill, before its
    long generation; an ordinary request was ``seen_early`` in vLLM's gauges (again, after
    vLLM is idle, if the look came too late).
    """
    text = f"Disconnect {kind} round {round_}: tell a very long story."
    if kind == "embeddings_fan_out":
        inputs = [f"input {i} of round {round_}" for i in range(FAN_OUT_INPUTS)]
        path, body = "/v1/embeddings", {"model": model, "input": inputs}
    else:
        stream = kind.endswith("stream")
        path = "/v1/chat/completions"
        body = long_body(model, text, flagged=kind.startswith("flagged"), stream=stream)
    missed: list[str] = []
    for _ in range(ATTEMPTS):
        before, published_before = progress(stack), ring_publishes(stack.ring_dir)

        def started() -> bool:
            if kind.endswith("stream"):
                # Not the client's first events: on a loaded machine the engine runs far
                # ahead of them (it finished whole requests before three events arrived).
                return seen_early(stack, before, generating=True)  # noqa: B023 - this iteration
            if kind.startswith("ordinary"):
                return seen_early(stack, before)  # noqa: B023 - likewise
            return ring_publishes(stack.ring_dir) > published_before  # noqa: B023 - likewise

        sock = raw_post(stack.proxy_url, path, json.dumps(body).encode())
        try:
            if wait_until(started, STARTED_WITHIN, interval=0.05) is None:
                sock.settimeout(1)
                try:
                    answer = sock.recv(1000)
                except TimeoutError:
                    answer = b"(nothing)"
                raise AssertionError(
                    f"{kind}: vLLM had nothing in flight; the proxy sent {answer!r}"
                )
        except MissedWindow as late:
            missed.append(str(late))
            sock.close()
            wait_idle(stack, ABORT_WITHIN)
            continue
        except BaseException:
            sock.close()
            raise
        try:
            hang_up(stack, sock, kind, before)
        except MissedWindow as late:
            missed.append(str(late))
            wait_idle(stack, ABORT_WITHIN)
            continue
        return before
    raise AssertionError(f"{kind}: vLLM was never caught early in a request: {missed}")


#: vLLM (uvicorn, 5 s keep-alive) closes every idle connection after 5 s; a loaded machine may
#: take longer, so this only bounds the wait for the proxy's connections to be gone.
IDLE_CLOSED_WITHIN = 60.0
#: The proxy's default fan-out limit: the most connections one client request opens.
FAN_OUT_LIMIT = ProxySettings.fan_out_limit


def test_client_disconnects_abort_upstream_and_leak_nothing(
    stack: RunningStack, model_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = proxy_process(stack)
    vllm_port = port_of(stack.vllm_url)
    short = chat_body(model_name, "warm", flagged=True, stream=False, tokens=1)
    response = httpx.post(stack.proxy_url + "/v1/chat/completions", json=short, timeout=30)
    assert response.status_code == 200, short_text(response)
    wait_idle(stack)

    def idle_connections_closed() -> float | None:
        return wait_until(lambda: connections_to(proxy, vllm_port) == 0, IDLE_CLOSED_WITHIN)

    assert idle_connections_closed() is not None, "idle connections to vLLM were never closed"
    rss_before = rss(proxy)

    rounds = 5
    peaks: list[int] = []
    settled: list[float | None] = []
    rss_by_round: list[int] = []
    to_idle: dict[str, list[float]] = {kind: [] for kind in DISCONNECTS}
    work: dict[str, list[float]] = {kind: [] for kind in DISCONNECTS}
    for round_ in range(rounds):
        for kind in DISCONNECTS:
            with vllm_engine_yielding(stack):
                then = disconnect_once(stack, model_name, kind, round_)
            to_idle[kind].append(wait_idle(stack, ABORT_WITHIN))
            now = progress(stack)
            completed = now.finished - then.finished
            if kind == "embeddings_fan_out":
                # The inputs in flight were aborted, the rest never sent.
                work[kind].append(completed)
                assert completed < FAN_OUT_INPUTS, f"{kind}: all {completed:g} inputs ran"
            else:
                # vLLM counts the tokens of a request it aborts only as far as its API server
                # had relayed them: a rough measure of how far the generation got.
                tokens = now.generated - then.generated
                work[kind].append(tokens)
                assert completed == 0 and tokens < FULL, (
                    f"{kind}: vLLM was not cut off mid-generation: {completed:g} requests "
                    f"completed, {tokens:g} of {FULL} tokens generated"
                )
            peaks.append(connections_to(proxy, vllm_port))
        # Idle connections kept for reuse (up to one per fan-out slot) close with keep-alive.
        settled.append(idle_connections_closed())
        rss_by_round.append(rss(proxy))
    # Still serving, with vectors.
    after = httpx.post(stack.proxy_url + "/v1/chat/completions", json=short, timeout=30)
    assert after.status_code == 200, short_text(after)
    assert after.json()["kv_transfer_params"]["last_hidden_state"]

    with capsys.disabled():
        print(
            f"\ndisconnects: {rounds * len(DISCONNECTS)}; per kind: seconds until vLLM had "
            f"nothing running or waiting (max); work vLLM did before the abort (each round):\n"
            + "\n".join(
                f"  {kind:<20} {max(to_idle[kind]):5.2f} s   "
                + " ".join(f"{done:6.0f}" for done in work[kind])
                + (
                    f" of {FAN_OUT_INPUTS} inputs"
                    if kind == "embeddings_fan_out"
                    else f" of {FULL} tokens"
                )
                for kind in DISCONNECTS
            )
            + f"\n  proxy connections to vLLM right after each disconnect {peaks}; seconds "
            f"until none was left after each round {settled}"
            f"\n  proxy RSS MiB: {rss_before / MIB:.1f} before, after each round "
            + ", ".join(f"{r / MIB:.1f}" for r in rss_by_round)
        )
    assert None not in settled, f"connections outlive keep-alive: {settled}"
    assert max(peaks) <= FAN_OUT_LIMIT + 2, peaks
    # The first round is the warm-up (a 2048-input fan-out raises the high water once). After
    # it, a leak grows every round, and a step of the allocator's high water only some.
    per_round = [after - before for before, after in itertools.pairwise(rss_by_round)]
    shown = ", ".join(f"{growth / MIB:+.1f}" for growth in per_round)
    assert min(per_round) < MAX_RSS_GROWTH_QUIET_ROUND, f"RSS grew every round (MiB): {shown}"
    assert sum(per_round) < MAX_RSS_GROWTH, f"RSS grew (MiB, each round): {shown}"


# --- upstream timeout -----------------------------------------------------------------------

READ_TIMEOUT = 0.5
PROXY_WITH_TIMEOUT = """
import os, sys
from vllm_hidden_state_proxy.protocol import UPSTREAM_API_KEY_ENV
from vllm_hidden_state_proxy.proxy.server import serve_proxy
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

upstream, ring_dir, port, timeout = sys.argv[1:5]
settings = ProxySettings(
    upstream_url=upstream,
    upstream_api_key=os.environ.get(UPSTREAM_API_KEY_ENV) or None,
    ring_dir=ring_dir,
    request_timeout=float(timeout),
    port=int(port),
    log_level="warning",
)
serve_proxy(settings)
"""


@dataclass
class ExtraProxy:
    url: str
    process: psutil.Process


@contextlib.contextmanager
def extra_proxy(
    upstream: str, ring_dir: Path, environment: dict[str, str] | None = None
) -> Iterator[ExtraProxy]:
    """A second proxy process in front of ``upstream``, with a 0.5 s read timeout
    (``environment``: e.g. vLLM's key, :meth:`RunningStack.upstream_environment`)."""
    port = free_port()
    arguments = [upstream, str(ring_dir), str(port), str(READ_TIMEOUT)]
    env = {**os.environ, **(environment or {})}
    process = subprocess.Popen([sys.executable, "-c", PROXY_WITH_TIMEOUT, *arguments], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        # Wait until it listens (its /health would ask the upstream).
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the extra proxy exited ({process.returncode})"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            assert time.monotonic() < deadline, "the extra proxy did not start listening"
            time.sleep(0.2)
        yield ExtraProxy(url, psutil.Process(process.pid))
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def short_timeout_proxy(stack: RunningStack) -> Iterator[ExtraProxy]:
    """A second proxy in front of the same vLLM, with a 0.5 s read timeout."""
    with extra_proxy(stack.vllm_url, stack.ring_dir, stack.upstream_environment()) as proxy:
        yield proxy


class BlackHole:
    """A TCP server that accepts connections, reads, and never answers: a hung upstream."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.listener.accept()[0])

    def closed_by_peer(self) -> int:
        """Accepted connections the other side (the proxy) has closed."""
        closed = 0
        for connection in self.accepted:
            connection.setblocking(False)
            try:
                while data := connection.recv(65536):
                    del data
            except BlockingIOError:
                continue
            except OSError:
                pass
            closed += 1
        return closed

    def close(self) -> None:
        self.listener.close()
        for connection in self.accepted:
            connection.close()


@pytest.fixture(scope="module")
def black_hole_proxy(stack: RunningStack) -> Iterator[tuple[ExtraProxy, BlackHole]]:
    """A proxy with a 0.5 s read timeout in front of an upstream that never answers (the
    ring directory is the real vLLM's, so that flagged requests are let through)."""
    hole = BlackHole()
    try:
        with extra_proxy(hole.url, stack.ring_dir) as proxy:
            yield proxy, hole
    finally:
        hole.close()


@pytest.mark.parametrize("kind", ["flagged", "ordinary", "passthrough", "embeddings"])
def test_an_upstream_that_never_answers_is_a_504_after_the_read_timeout(
    black_hole_proxy: tuple[ExtraProxy, BlackHole], model_name: str, kind: str
) -> None:
    """No vLLM involved (so no CPU contention): the read timeout alone must end the wait."""
    proxy, hole = black_hole_proxy
    closed_before = hole.closed_by_peer()
    # The black hole never answers: a 504 "gateway_timeout" can only be the proxy's read
    # timeout ending the wait (the client's own timeout, far longer, would raise instead).
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        if kind == "passthrough":
            response = client.get("/v1/models")
        elif kind == "embeddings":
            response = client.post("/v1/embeddings", json={"model": model_name, "input": "x"})
        else:
            body = chat_body(model_name, "hello", flagged=kind == "flagged", stream=False, tokens=1)
            response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 504, short_text(response)
    error = response.json()["error"]
    assert error["type"] == "gateway_timeout" and error["code"] == 504, error
    # The proxy let go of the upstream connection.
    assert wait_until(lambda: hole.closed_by_peer() > closed_before, 30) is not None


@pytest.mark.parametrize("flagged", [True, False], ids=["flagged", "ordinary"])
def test_vllm_that_stops_answering_is_a_prompt_504_and_the_request_is_aborted(
    stack: RunningStack,
    model_name: str,
    short_timeout_proxy: ExtraProxy,
    flagged: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM hangs (its engine stopped with SIGSTOP, its API server holding the connection and
    answering nothing) just after it received a long generation: the proxy answers 504 once its
    read timeout passes and lets go of the upstream connection; once vLLM goes on, it drops the
    request.

    The engine is frozen rather than merely slow because on this 2-core machine a busy vLLM
    delays other processes' timers by seconds (measured without the proxy: a 0.5 s httpx read
    timeout fired up to 2.7 s late while vLLM generated), which would make the proxy's read
    timeout fire at random; a frozen engine uses no CPU, and its API server, with nothing to
    relay, next to none. The engine goes on only once the API server has seen the proxy hang
    up (closed its end, which sends the engine its abort): stop 53's CI, with vLLM's processes
    all resumed at once, saw a loaded machine's engine finish the request first. An engine
    found (counters settled) ``too_late`` in the request when frozen is a missed window, tried
    again."""
    warm = chat_body(model_name, "warm", flagged=False, stream=False, tokens=2, **SLOW)
    direct = stack.vllm_url + "/v1/chat/completions"
    assert httpx.post(direct, json=warm, headers=stack.vllm_headers, timeout=60).is_success
    wait_idle(stack)
    vllm_port = port_of(stack.vllm_url)
    server = vllm_processes(stack)[0]
    body = long_body(model_name, "A long tale.", flagged=flagged, stream=False)
    missed: list[str] = []
    for _ in range(ATTEMPTS):
        before = progress(stack)
        start = time.monotonic()
        sock = raw_post(short_timeout_proxy.url, "/v1/chat/completions", json.dumps(body).encode())
        try:
            # Freeze the engine as soon as it is seen early in the request, or once the proxy
            # has answered (its read timeout may fire before a look at vLLM's gauges comes back).
            started = wait_until(
                lambda: seen_early(stack, before) or readable(sock),  # noqa: B023
                20,
                interval=0.02,
            )
            assert started is not None, "the long generation never started"
            with vllm_engine_frozen(stack):
                frozen_at = time.monotonic()
                look = settled_progress(stack)
                if too_late(look, before):
                    raise MissedWindow(
                        f"frozen at {look.generated - before.generated:g} of {FULL} tokens, "
                        f"{look.finished - before.finished:g} finished"
                    )
                answer = read_http_response(sock, timeout=30)
                answered_at = time.monotonic()
                # The proxy closes the connection as it answers; the socket goes on the loop's
                # next turn, which may come after the 504 reached us: wait for that state.
                let_go = wait_until(
                    lambda: connections_to(short_timeout_proxy.process, vllm_port) == 0,
                    30,
                    interval=0.02,
                )
                noticed = wait_until(
                    lambda: hang_ups_pending(server, vllm_port) == 0, HANG_UP_WITHIN
                )
        except MissedWindow as late:
            missed.append(str(late))
            sock.close()  # without an answer: the proxy sees the client leave and lets go
            wait_idle(stack, ABORT_WITHIN)
            continue
        finally:
            sock.close()
        break
    else:
        raise AssertionError(f"vLLM was never seen early in a generation: {missed}")
    assert answer is not None, "no answer within 30 s of vLLM hanging"
    status, content = answer
    assert status == 504, content[:500]
    error = json.loads(content)["error"]
    assert error["type"] == "gateway_timeout" and error["code"] == 504, error
    assert "did not answer in time" in error["message"]
    to_idle = wait_idle(stack, ABORT_WITHIN)
    with capsys.disabled():
        print(
            f"\nread timeout {READ_TIMEOUT} s, vLLM frozen {frozen_at - start:.2f} s after the "
            f"request: 504 {answered_at - start:.2f} s after the request "
            f"({answered_at - frozen_at:+.2f} s from the freeze); the proxy's connection to vLLM "
            f"closed {let_go} s after the 504; vLLM idle {to_idle:.2f} s after resuming"
        )
    assert let_go is not None, "the proxy still holds its connection to the hung vLLM"
    assert noticed is not None, "vLLM's API server never noticed the proxy hang up"
    assert progress(stack).finished == before.finished, "vLLM completed the request: not aborted"


def test_read_timeout_lets_short_requests_and_producing_streams_through(
    stack: RunningStack, model_name: str, short_timeout_proxy: ExtraProxy, reference: Reference
) -> None:
    text = "Short and sweet."
    body = chat_body(model_name, text, flagged=True, stream=False, tokens=1)
    response = httpx.post(short_timeout_proxy.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, short_text(response)
    messages = [{"role": "user", "content": text}]
    expected = reference.last_hidden_state(
        reference.chat_token_ids(messages, enable_thinking=False)
    )
    assert_matches(response.json()["kv_transfer_params"]["last_hidden_state"], expected)

    # The timeout is per read: a stream longer than it, producing all along, is not cut.
    body = chat_body(model_name, text, flagged=True, stream=True, tokens=600)
    response = httpx.post(short_timeout_proxy.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, short_text(response)
    events = check_complete_stream(response.text, tokens=600)
    assert_matches(events[0]["kv_transfer_params"]["last_hidden_state"], expected)


# --- slow readers ---------------------------------------------------------------------------


def probe(client: httpx.Client, model: str, kind: str, i: int) -> float:
    """One ordinary-sized request of ``kind`` through the proxy, checked; its latency."""
    text = f"Probe {kind} {i}: a short note."
    start = time.perf_counter()
    if kind == "embeddings":
        response = client.post("/v1/embeddings", json={"model": model, "input": text})
        assert response.status_code == 200, short_text(response)
        assert response.json()["data"][0]["embedding"]
    else:
        flagged, stream = kind.startswith("flagged"), kind.endswith("stream")
        body = chat_body(model, text, flagged=flagged, stream=stream, tokens=4)
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, short_text(response)
        if stream:
            chunks = check_complete_stream(response.text, tokens=4)
            assert bool(chunks[0].get("kv_transfer_params")) == flagged
        else:
            assert bool(response.json().get("kv_transfer_params")) == flagged
    return time.perf_counter() - start


PROBES = ("flagged", "ordinary", "flagged_stream", "embeddings")


def probe_latencies(stack: RunningStack, model: str, rounds: int) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {kind: [] for kind in PROBES}
    with httpx.Client(base_url=stack.proxy_url, timeout=60) as client:
        for i in range(rounds):
            for kind in PROBES:
                latencies[kind].append(probe(client, model, kind, i))
    return latencies


def test_slow_stream_readers_do_not_stall_other_clients(
    stack: RunningStack, model_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wait_idle(stack)
    probe_latencies(stack, model_name, rounds=2)  # warm-up
    baseline = probe_latencies(stack, model_name, rounds=10)

    stop_trickle = threading.Event()
    trickled: list[str] = []

    def trickle(response: httpx.Response) -> None:
        """Read one line per second until told to stop."""
        for line in response.iter_lines():
            trickled.append(line)
            if stop_trickle.wait(1.0):
                return

    def big_stream(text: str, flagged: bool) -> dict[str, Any]:
        return long_body(model_name, text, flagged=flagged, stream=True)

    proxy_port, vllm_port = port_of(stack.proxy_url), port_of(stack.vllm_url)
    url = stack.proxy_url + "/v1/chat/completions"
    with (
        httpx.Client(timeout=120) as stalled_client,
        httpx.Client(timeout=120) as trickle_client,
        stalled_client.stream("POST", url, json=big_stream("Stalled.", True)) as stalled,
        trickle_client.stream("POST", url, json=big_stream("Trickle.", False)) as trickling,
    ):
        assert stalled.status_code == 200 and trickling.status_code == 200
        reader = threading.Thread(target=trickle, args=(trickling,), daemon=True)
        reader.start()
        # vLLM finishes generating both while they back up: the proxy's sockets to the two
        # clients fill, the proxy stops reading those streams from vLLM, vLLM's sockets fill.
        wait_idle(stack, timeout=90)
        backed_up = wait_until(
            lambda: queue_bytes(proxy_port) > 0 and queue_bytes(vllm_port) > 0, 60
        )
        assert backed_up is not None, "the stalled streams never backed up into the sockets"
        loaded = probe_latencies(stack, model_name, rounds=10)  # each probe checked, none waits
        backlog = (queue_bytes(proxy_port), queue_bytes(vllm_port))  # still unread meanwhile
        stop_trickle.set()
        reader.join(timeout=10)
        # The stalled stream, read at last, is whole: the vector on its first chunk.
        chunks = check_complete_stream(stalled.read().decode(), tokens=FULL)
        assert chunks[0]["kv_transfer_params"]["last_hidden_state"]
    wait_idle(stack)

    lines = ["slow readers: probe latency ms, median (max), alone -> beside two stalled streams"]
    for kind in PROBES:
        lines.append(
            f"  {kind:<16}{statistics.median(baseline[kind]) * 1e3:8.1f} "
            f"({max(baseline[kind]) * 1e3:6.1f}) -> {statistics.median(loaded[kind]) * 1e3:8.1f} "
            f"({max(loaded[kind]) * 1e3:6.1f})"
        )
    lines.append(
        f"  meanwhile: the trickling client read {len(trickled)} lines; unread bytes queued in "
        f"the proxy's sockets to its clients {backlog[0] / MIB:.1f} MiB, in vLLM's sockets to "
        f"the proxy {backlog[1] / MIB:.1f} MiB; the stalled stream: {len(chunks)} chunks"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    # The point is a state, not a time: every probe was answered, and checked, while both
    # streams still held unread bytes in the sockets. The latencies above are for the eye.
    assert backlog[0] > 0 and backlog[1] > 0, backlog
