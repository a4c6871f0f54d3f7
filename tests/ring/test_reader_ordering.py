"""Item 10: a reader on a weakly ordered CPU (ARM, GH200) may see a ring's new publish counter
before the index entry stored ahead of it. These tests make the writer's stores visible out of
order by hand: the counter first, the index entry later (ring/reader.py, *Memory ordering*)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ring.helpers import assert_is_record_of, key_for, make_writer, publish_index
from vllm_hidden_state_proxy.ring import RingDirectory, RingReader, RingWriter
from vllm_hidden_state_proxy.ring import reader as reader_module
from vllm_hidden_state_proxy.ring.layout import INDEX_ENTRY_SIZE, ZERO_KEY


def publish_seen_early(writer: RingWriter, i: int, stale: bytes = ZERO_KEY) -> Callable[[], None]:
    """Publish record ``i``, but let readers see its index entry as ``stale`` (what another core
    may see before the writer's store reaches it). Returns what makes the real entry visible."""
    slot = writer.publish_count() % writer.slot_count
    publish_index(writer, i)
    mm = writer._mm
    assert mm is not None
    at = writer.shape.index_offset + slot * INDEX_ENTRY_SIZE
    real = mm[at : at + INDEX_ENTRY_SIZE]
    mm[at : at + INDEX_ENTRY_SIZE] = stale

    def visible() -> None:
        mm[at : at + INDEX_ENTRY_SIZE] = real

    return visible


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[RingWriter]:
    ring = make_writer(tmp_path, slot_count=4)
    yield ring
    ring.close()


def test_an_index_entry_read_as_zero_is_read_again_on_a_miss(
    tmp_path: Path, writer: RingWriter
) -> None:
    with RingDirectory(tmp_path) as rings:
        publish_index(writer, 0)
        assert_is_record_of(rings.lookup(key_for(0)), 0)
        visible = publish_seen_early(writer, 1)
        assert rings.lookup(key_for(1)) is None  # the counter moved, the entry looked empty
        visible()
        # Nothing else is published: before the fix, the reader never looked at that entry
        # again, and the record (there all along) ended in a 504.
        assert_is_record_of(rings.lookup(key_for(1)), 1)
        assert_is_record_of(rings.lookup(key_for(0)), 0)


def test_a_stale_previous_key_never_yields_the_wrong_record(tmp_path: Path) -> None:
    writer = make_writer(tmp_path, slot_count=1)
    try:
        with RingDirectory(tmp_path) as rings:
            publish_index(writer, 0)
            assert_is_record_of(rings.lookup(key_for(0)), 0)
            visible = publish_seen_early(writer, 1, stale=key_for(0))  # the slot's old key
            assert rings.lookup(key_for(0)) is None  # the slot holds record 1: not 0's
            assert rings.lookup(key_for(1)) is None
            visible()
            assert_is_record_of(rings.lookup(key_for(1)), 1)
            assert rings.lookup(key_for(0)) is None
    finally:
        writer.close()


def test_recheck_reads_only_recent_entries_and_then_forgets_them(
    writer: RingWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RingReader.open(writer.path) as reader:
        visible = publish_seen_early(writer, 0)
        assert reader.lookup(key_for(0)) is None
        assert not reader.recheck()  # still stale: nothing changed
        visible()
        assert reader.lookup(key_for(0)) is None  # a plain lookup does not look again
        assert reader.recheck()
        assert_is_record_of(reader.lookup(key_for(0)), 0)
        monkeypatch.setattr(reader_module, "SETTLE", 0.0)
        assert not reader.recheck()  # re-read at least SETTLE after the first read: settled
        assert not reader._unsettled


def test_the_entries_kept_for_a_recheck_stay_bounded_without_misses(writer: RingWriter) -> None:
    with RingReader.open(writer.path) as reader:
        for i in range(10 * writer.slot_count):
            key = publish_index(writer, i)
            assert_is_record_of(reader.lookup(key), i)
        assert sum(end - first for first, end, _ in reader._unsettled) <= 2 * writer.slot_count
