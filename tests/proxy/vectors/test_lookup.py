"""Finding a flagged request's record once vLLM has answered (proxy/vectors/lookup.py; what is
checked before sending: vectors/plan.py).

The waiting is checked on a virtual clock: ``time.monotonic`` and ``anyio.sleep`` of the module
are replaced, so the backoff, the deadline and "at once" are exact statements, not timings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anyio
import anyio.lowlevel
import httpx
import pytest

from tests.proxy.fakes import (
    FINAL,
    LAYERED,
    FakeRing,
    FakeVLLM,
    completion,
    error_of,
    forwarded_key,
    proxy_client,
    publishing_handler,
    record_for,
    ring_shape,
    settings_for,
)
from vllm_hidden_state_proxy.proxy.errors import ProxyError
from vllm_hidden_state_proxy.proxy.metrics import ProxyMetrics
from vllm_hidden_state_proxy.proxy.vectors import lookup
from vllm_hidden_state_proxy.proxy.vectors.lookup import (
    EARLY_INTERVAL,
    FIRST_BACKOFF,
    MAX_BACKOFF,
    EarlyCapture,
    wait_for_record,
)
from vllm_hidden_state_proxy.proxy.vectors.plan import check_rings, resolve_layers
from vllm_hidden_state_proxy.request_fields import VectorRequest
from vllm_hidden_state_proxy.ring import (
    EngineFailure,
    ErrorRecord,
    FailureNote,
    Found,
    RingDirectory,
    RingFormatError,
    RingWriter,
)
from vllm_hidden_state_proxy.wanted_vectors import WantedVectors

pytestmark = pytest.mark.anyio

KEY = bytes(range(16))
CHAT = "/v1/chat/completions"
FLAGGED = {"messages": [], "kv_transfer_params": {"return_last_hidden_state": True}}
FAILURE = EngineFailure(instance=1, engine=1, pid=4321, message="RingInUseError: held")


class VirtualClock:
    """Stands in for the module's ``time`` and ``asyncio.sleep``: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualClock]:
    virtual = VirtualClock()
    monkeypatch.setattr(lookup, "time", SimpleNamespace(monotonic=virtual.monotonic))
    fake_asyncio = SimpleNamespace(sleep=virtual.sleep, get_running_loop=asyncio.get_running_loop)
    monkeypatch.setattr(lookup, "asyncio", fake_asyncio)
    yield virtual


class CountdownRing(FakeRing):
    """The record appears on lookup number ``arrives_at`` (the worker is a little late)."""

    def __init__(self, arrives_at: int, found: Found | None = None, **details: object) -> None:
        super().__init__(**details)  # type: ignore[arg-type]
        self.arrives_at = arrives_at
        self.found = found or record_for(KEY)

    def lookup(self, key: bytes) -> Found | None:
        super().lookup(key)
        return self.found if self.lookups >= self.arrives_at else None


async def wait(ring: FakeRing, timeout: float = 1.0, early: Found | None = None) -> Found:
    metrics = ProxyMetrics()
    found = await wait_for_record(ring, KEY, {}, timeout, metrics, early)
    assert metrics.vector_wait.count == 1
    return found


def refused(status: int, excinfo: pytest.ExceptionInfo[ProxyError]) -> str:
    assert excinfo.value.status == status
    return excinfo.value.message


# ---------------------------------------------------------------------------------------------
# wait_for_record
# ---------------------------------------------------------------------------------------------


async def test_a_record_already_there_is_returned_without_waiting(clock: VirtualClock) -> None:
    ring = CountdownRing(1)
    assert await wait(ring) == record_for(KEY)
    assert (ring.lookups, clock.sleeps) == (1, [])


async def test_a_record_captured_early_is_used_without_a_lookup(clock: VirtualClock) -> None:
    ring = CountdownRing(10**9)
    assert await wait(ring, early=record_for(KEY, position=7)) == record_for(KEY, position=7)
    assert ring.lookups == 0


async def test_a_late_record_is_polled_for_with_a_doubling_interval(clock: VirtualClock) -> None:
    ring = CountdownRing(12)
    assert await wait(ring, timeout=60.0) == record_for(KEY)
    assert ring.lookups == 12
    expected = [min(FIRST_BACKOFF * 2**i, MAX_BACKOFF) for i in range(11)]
    assert clock.sleeps == pytest.approx(expected)
    assert clock.sleeps[-1] == MAX_BACKOFF  # capped


async def test_a_record_that_never_comes_is_504_at_the_deadline(clock: VirtualClock) -> None:
    ring = CountdownRing(10**9)
    metrics = ProxyMetrics()
    started = clock.now
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 0.25, metrics)
    message = refused(504, caught)
    assert "did not arrive within 0.25 s" in message and "not published" in message
    assert clock.now - started == pytest.approx(0.25)  # the last sleep ends at the deadline
    assert max(clock.sleeps) == MAX_BACKOFF
    assert metrics.vector_misses == {"overwritten": 0, "not_published": 1, "engine_without_ring": 0}
    assert metrics.vector_wait.count == 0


async def test_a_timeout_of_zero_looks_once(clock: VirtualClock) -> None:
    ring = CountdownRing(2)
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 0.0, ProxyMetrics())
    refused(504, caught)
    assert (ring.lookups, clock.sleeps) == (1, [])


async def test_an_overwritten_record_is_504_at_once_naming_the_slots(clock: VirtualClock) -> None:
    ring = CountdownRing(10**9, overwritten=True, slots=64)
    metrics = ProxyMetrics()
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 3600.0, metrics)
    message = refused(504, caught)
    assert "overwritten" in message and "(64 slots)" in message
    assert "HIDDEN_STATE_PROXY_RING_SLOTS" in message
    assert (ring.lookups, clock.sleeps) == (1, [])
    assert metrics.vector_misses["overwritten"] == 1


async def test_an_engine_without_a_ring_fails_at_once_naming_it(clock: VirtualClock) -> None:
    """The request may have landed on the engine whose hook could not start: waiting cannot
    help."""
    ring = CountdownRing(10**9, failures=(FAILURE,))
    metrics = ProxyMetrics()
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 3600.0, metrics)
    message = refused(503, caught)
    assert "engine 1 (data-parallel index)" in message
    assert "0000000000000001" in message and "pid 4321" in message
    assert "RingInUseError: held" in message
    assert (ring.lookups, clock.sleeps) == (1, [])
    assert metrics.vector_misses["engine_without_ring"] == 1


async def test_a_record_found_despite_a_failed_engine_is_used(clock: VirtualClock) -> None:
    ring = CountdownRing(1, failures=(FAILURE,))
    assert await wait(ring) == record_for(KEY)


@pytest.mark.parametrize("arrives_at", [1, 4])
async def test_an_error_record_is_502_with_the_hooks_message(
    clock: VirtualClock, arrives_at: int
) -> None:
    ring = CountdownRing(arrives_at, ErrorRecord(KEY, "could not copy the hidden states"))
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 60.0, ProxyMetrics())
    message = refused(502, caught)
    assert message == (
        "The vLLM worker hook could not produce the hidden state: could not copy the hidden states"
    )


async def test_a_record_for_another_key_is_a_miss(clock: VirtualClock) -> None:
    ring = CountdownRing(1, record_for(bytes(16)))
    with pytest.raises(ProxyError) as caught:
        await wait_for_record(ring, KEY, {}, 0.01, ProxyMetrics())
    refused(504, caught)
    assert ring.lookups > 1


# ---------------------------------------------------------------------------------------------
# EarlyCapture
# ---------------------------------------------------------------------------------------------


async def test_the_early_capture_polls_until_found(clock: VirtualClock) -> None:
    ring = CountdownRing(3)
    capture = EarlyCapture(ring, KEY, {})
    await capture.poll()
    assert capture.found == record_for(KEY)
    assert clock.sleeps == [EARLY_INTERVAL, EARLY_INTERVAL]


async def test_the_early_capture_gives_up_once_overwritten(clock: VirtualClock) -> None:
    ring = CountdownRing(10**9, overwritten=True)
    capture = EarlyCapture(ring, KEY, {})
    await capture.poll()
    assert capture.found is None
    assert ring.lookups == 1


async def test_the_early_capture_leaves_ring_trouble_to_the_direct_lookup(
    clock: VirtualClock,
) -> None:
    class BrokenRing(FakeRing):
        def lookup(self, key: bytes) -> Found | None:
            raise RingFormatError("ring-x.bin: truncated after mapping")

    capture = EarlyCapture(BrokenRing(), KEY, {})
    await capture.poll()
    assert capture.found is None


async def test_short_work_finishes_before_the_first_look() -> None:
    ring = CountdownRing(1)

    async def quick() -> None:
        return None

    capture = EarlyCapture(ring, KEY, {})
    await capture.during(quick())
    assert capture.found is None
    assert ring.lookups == 0  # only a timer was set, and cancelled


async def test_long_work_gets_the_record_captured_meanwhile() -> None:
    class SignallingRing(CountdownRing):
        def __init__(self) -> None:
            super().__init__(2)
            self.found_once = anyio.Event()

        def lookup(self, key: bytes) -> Found | None:
            found = super().lookup(key)
            if found is not None:
                self.found_once.set()
            return found

    ring = SignallingRing()

    async def generation() -> None:
        await ring.found_once.wait()

    capture = EarlyCapture(ring, KEY, {})
    with anyio.fail_after(60):
        await capture.during(generation())
    assert capture.found == record_for(KEY)


# ---------------------------------------------------------------------------------------------
# check_rings: before a flagged request is sent
# ---------------------------------------------------------------------------------------------


def test_check_rings_gives_the_live_shapes() -> None:
    assert check_rings(FakeRing(layers=(0, 4)), "/rings") == (ring_shape((0, 4)),)


def test_check_rings_without_a_ring_names_the_directory() -> None:
    with pytest.raises(ProxyError) as caught:
        check_rings(FakeRing(present=False), "/dev/shm/my-rings")
    message = refused(503, caught)
    assert "/dev/shm/my-rings" in message and "not active" in message


def test_check_rings_without_a_ring_but_with_failures_names_the_engines() -> None:
    with pytest.raises(ProxyError) as caught:
        check_rings(FakeRing(present=False, failures=(FAILURE,)), "/rings")
    assert "engine 1" in refused(503, caught)


def test_check_rings_in_a_refused_directory_names_the_reason() -> None:
    reason = "the ring directory /rings (mode 0o777) is writable by every user: ..."
    with pytest.raises(ProxyError) as caught:
        check_rings(FakeRing(present=False, refused=reason), "/rings")
    message = refused(503, caught)
    assert reason in message and "not active" not in message


def test_check_rings_refuses_rings_of_two_models(tmp_path: Path) -> None:
    """Two servers of different models share the directory (both started before either saw
    the other's ring, or a hook older than that check): no request can be resolved."""
    writers = [
        RingWriter.create(tmp_path, hidden_size=size, model="m", slot_count=2, instance=instance)
        for instance, size in ((1, 64), (2, 96))
    ]
    try:
        with RingDirectory(tmp_path) as rings, pytest.raises(ProxyError) as caught:
            check_rings(rings, str(tmp_path))
    finally:
        for writer in writers:
            writer.close()
    message = refused(503, caught)
    assert f"ring directory {tmp_path} holds the rings of vLLM servers of different models" in (
        message
    )
    assert "(hidden size 64, 1 decoder layer; hidden size 96, 1 decoder layer)" in message
    assert "its own ring directory" in message


def test_check_rings_when_the_last_ring_died_between_two_questions() -> None:
    class Vanishing(FakeRing):
        def live_shapes(self) -> tuple[()]:
            return ()

    with pytest.raises(ProxyError) as caught:
        check_rings(Vanishing(), "/rings")
    refused(503, caught)


# ---------------------------------------------------------------------------------------------
# resolve_layers: the layers asked for, in absolute indices of the live rings
# ---------------------------------------------------------------------------------------------


def wanted(layers: tuple[int, ...] | None = None, pooling: str = "last") -> WantedVectors:
    return resolve_layers(VectorRequest(layers=layers, pooling=pooling), [ring_shape(LAYERED)])


@pytest.mark.parametrize(
    ("asked", "absolute"),
    [
        (None, (FINAL,)),
        ((-1,), (FINAL,)),
        ((FINAL,), (FINAL,)),
        ((0, 2, 4), (0, 2, 4)),
        ((4, -5, -3), (4, 0, 2)),  # negative indices count from the end: -1 is N
        ((2, 2, -3), (2, 2, 2)),
    ],
)
def test_layers_resolve_to_absolute_indices_in_request_order(
    asked: tuple[int, ...] | None, absolute: tuple[int, ...]
) -> None:
    resolved = wanted(asked)
    assert resolved.layers == absolute
    assert resolved.final_layer == FINAL
    assert resolved.distinct_layers == tuple(sorted(set(absolute)))


@pytest.mark.parametrize("layer", [1, 3, 5, -2, -6, -100, 1 << 40])
def test_a_layer_the_server_does_not_capture_is_400_listing_the_captured(layer: int) -> None:
    with pytest.raises(ProxyError) as caught:
        wanted((0, layer))
    error = caught.value
    assert (error.status, error.param) == (400, "kv_transfer_params.last_hidden_state_layers")
    assert f"Layer {layer} is not captured" in error.message
    assert "captures layers 0, 2, 4 (the model has 4 decoder layers; -1 means 4" in error.message
    assert "--hidden-state-layers" in error.message


def test_only_layers_every_live_ring_captures_are_available() -> None:
    shapes = [ring_shape((0, 2, 4)), ring_shape((2, 4))]
    request = VectorRequest(layers=(2, -1))
    assert resolve_layers(request, shapes).layers == (2, 4)
    with pytest.raises(ProxyError, match="captures layers 2, 4 "):
        resolve_layers(VectorRequest(layers=(0,)), shapes, param="layer")


def test_the_param_can_be_named_by_the_caller() -> None:
    with pytest.raises(ProxyError) as caught:
        resolve_layers(VectorRequest(layers=(1,)), [ring_shape()], param="layer")
    assert caught.value.param == "layer"


# ---------------------------------------------------------------------------------------------
# through the app
# ---------------------------------------------------------------------------------------------


async def test_a_request_landing_on_an_engine_without_a_ring_fails_at_once(
    ring_dir: str, writer: RingWriter
) -> None:
    """Engine 0 of instance 1 publishes; engine 1's hook could not start. A request vLLM
    routed to engine 1 gets a 503 naming it, not a 504 after the (hour-long) vector timeout."""
    note = FailureNote.write(ring_dir, instance=1, engine=1, message="OSError: no space left")
    vllm = FakeVLLM(publishing_handler(None))
    try:
        settings = settings_for(ring_dir, vector_timeout=3600)
        async with proxy_client(settings, vllm) as proxy:
            with anyio.fail_after(60):
                response = await proxy.client.post(CHAT, json=FLAGGED)
            assert proxy.metrics.vector_misses["engine_without_ring"] == 1
    finally:
        note.close()
    assert response.status_code == 503
    error = error_of(response)
    assert error["type"] == "service_unavailable"
    assert "engine 1 (data-parallel index)" in error["message"]
    assert "OSError: no space left" in error["message"]
    assert len(vllm.requests) == 1  # admitted: engine 0 publishes


async def test_requests_landing_on_the_engine_with_a_ring_still_get_their_vector(
    ring_dir: str, writer: RingWriter
) -> None:
    note = FailureNote.write(ring_dir, instance=1, engine=1, message="no space")
    try:
        async with proxy_client(settings_for(ring_dir), FakeVLLM(publishing_handler(writer))) as p:
            response = await p.client.post(CHAT, json=FLAGGED)
    finally:
        note.close()
    assert response.status_code == 200, response.text


async def test_an_error_record_is_a_502_with_the_hooks_message(
    ring_dir: str, writer: RingWriter
) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        writer.publish_error(forwarded_key(request), "CUDA error: an illegal memory access")
        return httpx.Response(200, json=completion())

    async with proxy_client(settings_for(ring_dir, vector_timeout=3600), FakeVLLM(handle)) as p:
        with anyio.fail_after(60):
            response = await p.client.post(CHAT, json=FLAGGED)
    assert response.status_code == 502
    error = error_of(response)
    assert error["type"] == "bad_gateway"
    assert error["message"].endswith("CUDA error: an illegal memory access")


def test_the_layers_to_capture_are_ascending_and_each_once() -> None:
    wanted = WantedVectors(VectorRequest(layers=(4, 0, -1)), layers=(4, 0, 4), final_layer=4)
    assert wanted.distinct_layers == (0, 4)
