"""Tests for the shared-memory hidden-state ring (src/vllm_hidden_state_proxy/ring.py)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_hidden_state_proxy
from vllm_hidden_state_proxy import ring
from vllm_hidden_state_proxy.ring import (
    HDR_MAGIC_OFFSET,
    HDR_PUBLISH_COUNT_OFFSET,
    HDR_SLOT_COUNT_OFFSET,
    HDR_VERSION_OFFSET,
    HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_OFFSET,
    REQUEST_KEY_BYTES,
    SLOT_CRC_OFFSET,
    SLOT_KEY_OFFSET,
    SLOT_LEN_OFFSET,
    SLOT_PAYLOAD_OFFSET,
    SLOT_SEQ_OFFSET,
    Record,
    RingDirectory,
    RingFormatError,
    RingInUseError,
    RingReader,
    RingWriter,
    slot_size_for,
)

LOGGER = "vllm_hidden_state_proxy.ring"
MODEL = "test/model-7b"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def key_for(i: int) -> bytes:
    # Same derivation as in WRITER_SCRIPT below.
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=REQUEST_KEY_BYTES).digest()


def vector_for(key: bytes, hidden_size: int) -> bytes:
    # Same derivation as in WRITER_SCRIPT below. hidden_size must be a multiple of 4.
    return key * (4 * hidden_size // REQUEST_KEY_BYTES)


def floats_vector(values: list[float]) -> bytes:
    arr = array("f", values)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def make_writer(
    directory: Path, *, hidden_size: int = 8, slot_count: int = 4, writer_id: str = "dp0"
) -> RingWriter:
    return RingWriter.create(
        directory,
        writer_id=writer_id,
        hidden_size=hidden_size,
        model=MODEL,
        slot_count=slot_count,
    )


def publish_index(w: RingWriter, i: int) -> bytes:
    k = key_for(i)
    w.publish(k, vector_for(k, w.hidden_size), position=i, num_prompt_tokens=i + 1)
    return k


def assert_is_record_of(rec: Record | None, i: int, hidden_size: int) -> None:
    k = key_for(i)
    assert rec is not None
    assert rec == Record(
        key=k,
        vector=vector_for(k, hidden_size),
        hidden_size=hidden_size,
        position=i,
        num_prompt_tokens=i + 1,
        model=MODEL,
    )


def slots_offset(slot_count: int) -> int:
    return (INDEX_OFFSET + slot_count * INDEX_ENTRY_SIZE + 63) // 64 * 64


def slot_offset(r: RingReader | RingWriter, slot: int) -> int:
    return slots_offset(r.slot_count) + slot * r.slot_size


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name("." + path.name + ".new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@pytest.fixture
def rw_map(tmp_path: Path) -> Iterator[tuple[RingWriter, RingReader, mmap.mmap]]:
    """A writer, a reader and a separate writable mapping for tampering with the file."""
    w = make_writer(tmp_path / "rings")
    r = RingReader.open(w.path)
    with open(w.path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    yield w, r, mm
    mm.close()
    r.close()
    w.close()


def valid_ring_bytes(tmp_path: Path, *, records: int = 3) -> bytes:
    src = tmp_path / "src"
    w = make_writer(src, hidden_size=8, slot_count=4, writer_id="src")
    for i in range(records):
        publish_index(w, i)
    w.close()
    data = w.path.read_bytes()
    w.path.unlink()
    return data


# ---------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------


def test_round_trip_all_fields(tmp_path: Path) -> None:
    d = tmp_path / "rings"
    hidden = 16
    w = RingWriter.create(d, writer_id="dp0", hidden_size=hidden, model=MODEL, slot_count=8)
    values = [float(j) * 0.5 - 3.0 for j in range(hidden)]
    key = bytes(range(1, 17))
    w.publish(key, floats_vector(values), position=41, num_prompt_tokens=42)

    assert w.path == d / "ring-dp0.bin"
    assert os.listdir(d) == ["ring-dp0.bin"]  # no temp file left behind
    assert (os.stat(d).st_mode & 0o777) == 0o700
    assert (os.stat(w.path).st_mode & 0o777) == 0o600

    r = RingReader.open(w.path)
    assert r.epoch == w.epoch != 0
    assert (r.hidden_size, r.slot_count, r.slot_size) == (hidden, 8, w.slot_size)
    assert r.slot_size == slot_size_for(hidden, MODEL)
    assert r.writer_pid == os.getpid()
    assert r.publish_count == 1
    rec = r.lookup(key)
    assert rec == Record(
        key=key,
        vector=floats_vector(values),
        hidden_size=hidden,
        position=41,
        num_prompt_tokens=42,
        model=MODEL,
    )
    assert rec.as_floats() == values
    assert r.lookup(bytes(range(2, 18))) is None
    r.close()
    w.close()


def test_header_bytes_match_contract(tmp_path: Path) -> None:
    w = make_writer(tmp_path, hidden_size=8, slot_count=4)
    k = publish_index(w, 0)
    data = w.path.read_bytes()
    assert data[HDR_MAGIC_OFFSET : HDR_MAGIC_OFFSET + 8] == b"VHSRING\x00"
    assert struct.unpack_from("<I", data, HDR_VERSION_OFFSET)[0] == ring.LAYOUT_VERSION
    assert struct.unpack_from("<I", data, HDR_SLOT_COUNT_OFFSET)[0] == 4
    assert struct.unpack_from("<Q", data, HDR_PUBLISH_COUNT_OFFSET)[0] == 1
    assert struct.unpack_from("<Q", data, ring.HDR_EPOCH_OFFSET)[0] == w.epoch
    assert data[INDEX_OFFSET : INDEX_OFFSET + REQUEST_KEY_BYTES] == k
    assert data[INDEX_OFFSET + REQUEST_KEY_BYTES : INDEX_OFFSET + 2 * REQUEST_KEY_BYTES] == bytes(
        REQUEST_KEY_BYTES
    )
    off = slot_offset(w, 0)
    assert off % 64 == 0
    assert struct.unpack_from("<Q", data, off + SLOT_SEQ_OFFSET)[0] == 2  # even after one write
    assert data[off + SLOT_KEY_OFFSET : off + SLOT_KEY_OFFSET + REQUEST_KEY_BYTES] == k
    n = struct.unpack_from("<I", data, off + SLOT_LEN_OFFSET)[0]
    payload = data[off + SLOT_PAYLOAD_OFFSET : off + SLOT_PAYLOAD_OFFSET + n]
    assert struct.unpack_from("<I", data, off + SLOT_CRC_OFFSET)[0] == zlib.crc32(payload)
    assert msgpack.unpackb(payload) == {
        "key": k,
        "vector": vector_for(k, 8),
        "hidden_size": 8,
        "position": 0,
        "num_prompt_tokens": 1,
        "model": MODEL,
    }
    w.close()


def test_slot_size_for() -> None:
    for hidden in (1, 8, 4096, 8192):
        size = slot_size_for(hidden, MODEL)
        assert size % 64 == 0
        assert size >= SLOT_PAYLOAD_OFFSET + 4 * hidden + REQUEST_KEY_BYTES
    assert slot_size_for(4096, "m" * 200) > slot_size_for(4096, "m")
    with pytest.raises(ValueError):
        slot_size_for(0, MODEL)


def test_publish_and_create_validation(tmp_path: Path) -> None:
    w = make_writer(tmp_path, hidden_size=8)
    good = key_for(1)
    with pytest.raises(ValueError):
        w.publish(good, b"\x00" * 31, position=0, num_prompt_tokens=1)
    with pytest.raises(ValueError):
        w.publish(b"short", b"\x00" * 32, position=0, num_prompt_tokens=1)
    with pytest.raises(ValueError):
        w.publish(bytes(REQUEST_KEY_BYTES), b"\x00" * 32, position=0, num_prompt_tokens=1)
    with pytest.raises(ValueError):
        w.publish(good, b"\x00" * 32, position=1 << 70, num_prompt_tokens=1)
    assert w.publish_count == 0  # nothing was written by the rejected calls
    for bad_id in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(ValueError):
            RingWriter.create(tmp_path, writer_id=bad_id, hidden_size=8, model=MODEL, slot_count=2)
    with pytest.raises(ValueError):
        RingWriter.create(
            tmp_path, writer_id="x", hidden_size=8, model=MODEL, slot_count=2, file_mode=0o666
        )
    w.close()
    with pytest.raises(ValueError):
        w.publish(good, b"\x00" * 32, position=0, num_prompt_tokens=1)


def test_lookup_rejects_malformed_keys(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    k = publish_index(w, 0)
    r = RingReader.open(w.path)
    assert r.lookup(k) is not None
    assert r.lookup(k[:15]) is None
    assert r.lookup(k + b"\x00") is None
    assert r.lookup(bytes(REQUEST_KEY_BYTES)) is None  # empty index entries are zeros
    assert r.lookup(bytearray(k)) is None  # type: ignore[arg-type]
    r.close()
    assert r.lookup(k) is None  # closed reader: a miss, not a crash
    w.close()


def test_close_leaves_file_readable(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    publish_index(w, 7)
    w.close()
    assert w.path.exists()
    with RingReader.open(w.path) as r:
        assert_is_record_of(r.lookup(key_for(7)), 7, 8)


def test_wrap_around(tmp_path: Path) -> None:
    w = make_writer(tmp_path, slot_count=4)
    for i in range(10):
        publish_index(w, i)
    r = RingReader.open(w.path)
    assert r.publish_count == 10
    for i in range(6):
        assert r.lookup(key_for(i)) is None
    for i in range(6, 10):
        assert_is_record_of(r.lookup(key_for(i)), i, 8)
    r.close()
    w.close()


# ---------------------------------------------------------------------------------------------
# tampering: the reader must prove what it read
# ---------------------------------------------------------------------------------------------


def test_odd_seq_means_torn(rw_map: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    w, r, mm = rw_map
    k = publish_index(w, 0)
    off = slot_offset(w, 0) + SLOT_SEQ_OFFSET
    seq = struct.unpack_from("<Q", mm, off)[0]
    assert r.lookup(k) is not None
    struct.pack_into("<Q", mm, off, seq + 1)
    assert r.lookup(k) is None
    struct.pack_into("<Q", mm, off, seq)
    assert_is_record_of(r.lookup(k), 0, 8)


def test_corrupt_payload_fails_crc(rw_map: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    w, r, mm = rw_map
    k = publish_index(w, 0)
    pos = slot_offset(w, 0) + SLOT_PAYLOAD_OFFSET + 40  # inside the vector bytes
    orig = mm[pos]
    mm[pos] = orig ^ 0xFF
    assert r.lookup(k) is None
    mm[pos] = orig
    assert_is_record_of(r.lookup(k), 0, 8)


def test_changed_slot_key(rw_map: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    w, r, mm = rw_map
    k = publish_index(w, 0)
    off = slot_offset(w, 0) + SLOT_KEY_OFFSET
    mm[off : off + REQUEST_KEY_BYTES] = key_for(99)
    assert r.lookup(k) is None
    assert r.lookup(key_for(99)) is None  # not in the index
    mm[off : off + REQUEST_KEY_BYTES] = k
    assert_is_record_of(r.lookup(k), 0, 8)


def test_oversized_length_field(rw_map: tuple[RingWriter, RingReader, mmap.mmap]) -> None:
    w, r, mm = rw_map
    k = publish_index(w, 0)
    off = slot_offset(w, 0) + SLOT_LEN_OFFSET
    n = struct.unpack_from("<I", mm, off)[0]
    struct.pack_into("<I", mm, off, 0xFFFFFFFF)
    assert r.lookup(k) is None
    struct.pack_into("<I", mm, off, n)
    assert r.lookup(k) is not None


def test_index_hit_on_overwritten_slot_never_returns_other_record(
    rw_map: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    w, r, mm = rw_map
    k0 = publish_index(w, 0)  # slot 0
    k1 = publish_index(w, 1)  # slot 1
    # Index now claims k0 lives in slot 1 (which holds k1's record), and forgets slot 0.
    mm[INDEX_OFFSET : INDEX_OFFSET + REQUEST_KEY_BYTES] = bytes(REQUEST_KEY_BYTES)
    mm[INDEX_OFFSET + REQUEST_KEY_BYTES : INDEX_OFFSET + 2 * REQUEST_KEY_BYTES] = k0
    assert r.lookup(k0) is None
    # Also forge slot 1's key field to k0: the payload (valid CRC) still says k1.
    off = slot_offset(w, 1) + SLOT_KEY_OFFSET
    mm[off : off + REQUEST_KEY_BYTES] = k0
    assert r.lookup(k0) is None
    # Restoring slot 0's index entry makes k0 findable again (the test setup is not vacuous).
    mm[INDEX_OFFSET : INDEX_OFFSET + REQUEST_KEY_BYTES] = k0
    assert_is_record_of(r.lookup(k0), 0, 8)
    assert r.lookup(k1) is None  # k1 lost its index entry


def test_payload_key_mismatch_with_valid_crc(
    rw_map: tuple[RingWriter, RingReader, mmap.mmap],
) -> None:
    w, r, mm = rw_map
    k0 = publish_index(w, 0)
    other = key_for(5)
    payload = msgpack.packb(
        {
            "key": other,
            "vector": vector_for(other, 8),
            "hidden_size": 8,
            "position": 5,
            "num_prompt_tokens": 6,
            "model": MODEL,
        }
    )
    off = slot_offset(w, 0)
    mm[off + SLOT_PAYLOAD_OFFSET : off + SLOT_PAYLOAD_OFFSET + len(payload)] = payload
    struct.pack_into("<II", mm, off + SLOT_LEN_OFFSET, len(payload), zlib.crc32(payload))
    assert r.lookup(k0) is None


def test_unaligned_index_match_is_skipped(tmp_path: Path) -> None:
    w = make_writer(tmp_path, slot_count=4)
    ka = key_for(1)
    kb = key_for(2)
    straddle = ka[8:] + kb[:8]
    for k in (ka, kb):
        w.publish(k, vector_for(k, 8), position=1, num_prompt_tokens=2)
    r = RingReader.open(w.path)
    assert r.lookup(straddle) is None  # occurs at index offset 8 only: not an entry
    # Now publish the straddling key itself: the unaligned occurrence comes first in the index.
    w.publish(straddle, vector_for(straddle, 8), position=3, num_prompt_tokens=4)
    rec = r.lookup(straddle)
    assert rec is not None
    assert rec.key == straddle
    assert rec.position == 3
    r.close()
    w.close()


# ---------------------------------------------------------------------------------------------
# a writer in another process
# ---------------------------------------------------------------------------------------------

WRITER_SCRIPT = r"""
import hashlib, sys, time
from vllm_hidden_state_proxy.ring import RingWriter

directory, hidden = sys.argv[1], int(sys.argv[2])
seconds, max_records = float(sys.argv[3]), int(sys.argv[4])
w = RingWriter.create(directory, writer_id="proc", hidden_size=hidden, model="test/model-7b",
                      slot_count=8)
print("ready", flush=True)
deadline = time.monotonic() + seconds
i = 0
while i < max_records and (i % 64 or time.monotonic() < deadline):
    k = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
    w.publish(k, k * (4 * hidden // 16), position=i, num_prompt_tokens=i + 1)
    i += 1
w.close()
print("done", i, flush=True)
"""


def subprocess_env() -> dict[str, str]:
    pkg_parent = str(Path(vllm_hidden_state_proxy.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    return env


def test_concurrent_writer_process(tmp_path: Path) -> None:
    hidden = 1024
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(tmp_path), str(hidden), "1.5", "2000000"],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        r = RingReader.open(tmp_path / "ring-proc.bin")
        hits = misses = 0
        while proc.poll() is None:
            c = r.publish_count
            for i in range(max(0, c - 9), c + 2):
                rec = r.lookup(key_for(i))
                if rec is None:
                    misses += 1
                else:
                    assert_is_record_of(rec, i, hidden)
                    hits += 1
        out = proc.stdout.read().split()
        assert proc.wait(timeout=30) == 0
        assert out[0] == "done"
        total = int(out[1])
        assert r.publish_count == total
        # Quiescent: the newest 8 are all there and exact, the one before is gone.
        for i in range(total - 8, total):
            assert_is_record_of(r.lookup(key_for(i)), i, hidden)
        assert r.lookup(key_for(total - 9)) is None
        r.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert total > 1000
    assert hits > 100, (hits, misses)
    assert misses > 0, (hits, misses)  # we did race against overwrites
    print(f"concurrent: {total} published, {hits} hits, {misses} misses")


# ---------------------------------------------------------------------------------------------
# RingDirectory: restarts, bad files, security
# ---------------------------------------------------------------------------------------------


def test_directory_follows_writer_restart(tmp_path: Path) -> None:
    w1 = make_writer(tmp_path)
    k1 = publish_index(w1, 1)
    rd = RingDirectory(tmp_path)
    rd_periodic = RingDirectory(tmp_path)
    old_reader = RingReader.open(w1.path)
    assert rd.epochs == {"ring-dp0.bin": w1.epoch}
    assert_is_record_of(rd.lookup(k1), 1, 8)
    assert_is_record_of(rd_periodic.lookup(k1), 1, 8)

    w1.close()  # vLLM exited (its liveness lock is released) ...
    w2 = make_writer(tmp_path)  # ... and restarted: same writer_id, new file
    assert w2.path == w1.path
    assert w2.epoch != w1.epoch
    assert old_reader.is_stale()
    assert not RingReader.open(w2.path).is_stale()
    k2 = publish_index(w2, 2)

    rd.refresh()
    assert rd.epochs == {"ring-dp0.bin": w2.epoch}
    assert rd.lookup(k1) is None  # the old file's records are gone with it
    assert_is_record_of(rd.lookup(k2), 2, 8)

    # Without an explicit refresh, a lookup notices the restart within CHECK_INTERVAL.
    time.sleep(RingDirectory.CHECK_INTERVAL + 0.02)
    assert rd_periodic.lookup(k1) is None
    assert rd_periodic.epochs == {"ring-dp0.bin": w2.epoch}
    assert_is_record_of(rd_periodic.lookup(k2), 2, 8)

    # The old reader still works on the (now unlinked) mapping: no crash.
    assert_is_record_of(old_reader.lookup(k1), 1, 8)
    for obj in (old_reader, rd, rd_periodic, w1, w2):
        obj.close()


def test_directory_new_writer_picked_up_on_miss(tmp_path: Path) -> None:
    rd = RingDirectory(tmp_path / "not-yet")
    assert not rd.has_ring()
    assert rd.epochs == {}
    w = make_writer(tmp_path / "not-yet", writer_id="dp1")
    k = publish_index(w, 3)
    assert rd.has_ring()  # refreshes because it had none
    assert_is_record_of(rd.lookup(k), 3, 8)
    w2 = make_writer(tmp_path / "not-yet", writer_id="dp2")
    k2 = publish_index(w2, 4)
    time.sleep(RingDirectory.CHECK_INTERVAL + 0.02)
    assert_is_record_of(rd.lookup(k2), 4, 8)
    assert set(rd.epochs) == {"ring-dp1.bin", "ring-dp2.bin"}
    rd.close()
    assert rd.lookup(k) is None
    w.close()
    w2.close()


def _corrupt_variants(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    good = valid_ring_bytes(tmp_path)

    def with_u32(offset: int, value: int) -> bytes:
        b = bytearray(good)
        struct.pack_into("<I", b, offset, value)
        return bytes(b)

    return {
        "wrong-magic": (b"NOTRING\x00" + good[8:], "bad magic"),
        "version-0": (with_u32(HDR_VERSION_OFFSET, 0), "not ready"),
        "version-99": (with_u32(HDR_VERSION_OFFSET, 99), "unsupported layout version"),
        "empty": (b"", "truncated header"),
        "truncated-header": (good[:30], "truncated header"),
        "truncated-body": (good[: len(good) - 100], "bytes but the header describes"),
        "random": (os.urandom(len(good)), "bad magic"),
        "huge-slot-count": (with_u32(HDR_SLOT_COUNT_OFFSET, 0xFFFFFFFF), "slot count"),
        "big-slot-count": (with_u32(HDR_SLOT_COUNT_OFFSET, 1 << 20), "header describes"),
        "zero-slot-count": (with_u32(HDR_SLOT_COUNT_OFFSET, 0), "slot count"),
        "bad-key-size": (with_u32(ring.HDR_KEY_SIZE_OFFSET, 8), "key size"),
        "bad-slot-size": (with_u32(ring.HDR_SLOT_SIZE_OFFSET, 65), "slot size"),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "wrong-magic",
        "version-0",
        "version-99",
        "empty",
        "truncated-header",
        "truncated-body",
        "random",
        "huge-slot-count",
        "big-slot-count",
        "zero-slot-count",
        "bad-key-size",
        "bad-slot-size",
    ],
)
def test_corrupt_file_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, variant: str
) -> None:
    data, reason = _corrupt_variants(tmp_path)[variant]
    d = tmp_path / "rings"
    d.mkdir()
    bad = d / "ring-bad.bin"
    write_file(bad, data)
    with pytest.raises(RingFormatError, match=reason):
        RingReader.open(bad)

    good_writer = make_writer(d, writer_id="good")
    k = publish_index(good_writer, 0)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rd = RingDirectory(d)
    assert_is_record_of(rd.lookup(k), 0, 8)
    assert rd.lookup(key_for(1)) is None
    assert rd.epochs == {"ring-good.bin": good_writer.epoch}
    refusals = [
        rec for rec in caplog.records if rec.name == LOGGER and "ring-bad.bin" in rec.getMessage()
    ]
    assert len(refusals) == 1
    assert reason in refusals[0].getMessage()
    assert refusals[0].levelno == logging.WARNING
    rd.refresh()
    time.sleep(RingDirectory.CHECK_INTERVAL + 0.01)
    assert rd.lookup(key_for(1)) is None  # triggers a periodic rescan too
    assert len([r for r in caplog.records if "ring-bad.bin" in r.getMessage()]) == 1  # once
    rd.close()
    good_writer.close()


def test_temp_and_foreign_files_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    write_file(tmp_path / ".ring-dp0.abc.tmp", b"half made")
    write_file(tmp_path / "notes.txt", b"hello")
    (tmp_path / "ring-dir.bin").mkdir()
    rd = RingDirectory(tmp_path)
    assert not rd.has_ring()
    messages = [r.getMessage() for r in caplog.records]
    assert not any("ring-dp0" in m or "notes" in m for m in messages)
    assert any("ring-dir.bin" in m and "regular file" in m for m in messages)
    rd.close()


def test_symlink_refused(tmp_path: Path) -> None:
    w = make_writer(tmp_path / "real")
    link = tmp_path / "ring-link.bin"
    link.symlink_to(w.path)
    with pytest.raises(RingFormatError, match="cannot open"):
        RingReader.open(link)
    w.close()


def test_truncated_after_mapping(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    w = make_writer(tmp_path, slot_count=64)
    k = publish_index(w, 0)
    r = RingReader.open(w.path)
    rd = RingDirectory(tmp_path)
    assert r.lookup(k) is not None
    assert rd.lookup(k) is not None
    os.truncate(w.path, 100)  # pages past EOF of a live mapping would SIGBUS if touched
    with pytest.raises(RingFormatError, match="truncated after mapping"):
        r.lookup(k)
    with pytest.raises(RingFormatError):
        _ = r.publish_count
    assert rd.lookup(k) is None
    assert rd.epochs == {}
    assert any("truncated after mapping" in rec.getMessage() for rec in caplog.records)
    os.truncate(w.path, 0)
    assert rd.lookup(k) is None
    with pytest.raises(RingFormatError):
        RingReader.open(w.path)
    r.close()
    rd.close()
    w.close()


def test_group_writable_file_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    w = make_writer(tmp_path)
    k = publish_index(w, 0)
    os.chmod(w.path, 0o666)
    with pytest.raises(RingFormatError, match="writable by group/others"):
        RingReader.open(w.path)
    os.chmod(w.path, 0o620)
    with pytest.raises(RingFormatError, match="writable by group/others"):
        RingReader.open(w.path)
    rd = RingDirectory(tmp_path)
    assert not rd.has_ring()
    assert rd.lookup(k) is None
    assert any("writable by group/others" in rec.getMessage() for rec in caplog.records)
    os.chmod(w.path, 0o640)  # fixed in place: picked up on the next refresh
    rd.refresh()
    assert_is_record_of(rd.lookup(k), 0, 8)
    rd.close()
    w.close()


def test_foreign_owner_refused(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    k = publish_index(w, 0)
    uid = os.stat(w.path).st_uid
    with pytest.raises(RingFormatError, match="expected uid"):
        RingReader.open(w.path, expected_uid=uid + 1)
    rd_bad = RingDirectory(tmp_path, expected_uid=uid + 1)
    assert rd_bad.lookup(k) is None
    assert not rd_bad.has_ring()
    rd_ok = RingDirectory(tmp_path, expected_uid=uid)
    assert_is_record_of(rd_ok.lookup(k), 0, 8)
    rd_bad.close()
    rd_ok.close()
    w.close()


# ---------------------------------------------------------------------------------------------
# liveness: one live writer per name; a dead writer's file is readable but does not count
# ---------------------------------------------------------------------------------------------

HOLDER_SCRIPT = r"""
import hashlib, sys, time
from vllm_hidden_state_proxy.ring import RingWriter

w = RingWriter.create(sys.argv[1], writer_id="proc", hidden_size=8, model="test/model-7b",
                      slot_count=4)
for i in range(3):
    k = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
    w.publish(k, k * 2, position=i, num_prompt_tokens=i + 1)
print("ready", flush=True)
time.sleep(120)
"""


def test_second_writer_with_same_id_refused(tmp_path: Path) -> None:
    d = tmp_path / "rings"
    w1 = make_writer(d)
    k0 = publish_index(w1, 0)
    rd = RingDirectory(d)
    assert rd.has_ring()

    t0 = time.monotonic()
    with pytest.raises(RingInUseError) as excinfo:
        make_writer(d)  # a second vLLM (or rank) with the same writer id
    waited = time.monotonic() - t0
    message = str(excinfo.value)
    assert str(w1.path) in message
    assert "another vLLM instance" in message
    assert "its own ring directory" in message
    assert ring.IN_USE_WAIT <= waited < ring.IN_USE_WAIT + 2.0  # retried, but not forever
    assert os.listdir(d) == ["ring-dp0.bin"]  # the loser's temp file is gone
    with RingReader.open(w1.path) as r:
        assert r.epoch == w1.epoch  # not replaced
        assert r.is_live()

    # The first writer keeps working and stays findable.
    k1 = publish_index(w1, 1)
    assert rd.has_ring()
    assert rd.epochs == {"ring-dp0.bin": w1.epoch}
    assert_is_record_of(rd.lookup(k0), 0, 8)
    assert_is_record_of(rd.lookup(k1), 1, 8)

    # A different writer id next to it is fine.
    make_writer(d, writer_id="dp1").close()

    # Once the first writer is gone, its name is free again.
    w1.close()
    w2 = make_writer(d)
    assert w2.epoch != w1.epoch
    with RingReader.open(w2.path) as r:
        assert r.epoch == w2.epoch
    assert sorted(os.listdir(d)) == ["ring-dp0.bin", "ring-dp1.bin"]
    rd.close()
    w2.close()


def test_killed_writer_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    rd = RingDirectory(tmp_path)
    w: RingWriter | None = None
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        assert rd.has_ring()
        assert rd.publish_count() == 3
        assert rd.min_slot_count() == 4
        with pytest.raises(RingInUseError, match=r"ring-proc\.bin"):
            make_writer(tmp_path, writer_id="proc")

        assert rd.has_ring()  # fresh "live" answer in the cache
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        died = time.monotonic()
        while rd.has_ring():
            assert time.monotonic() - died < RingDirectory.LIVENESS_INTERVAL + 1.0
            time.sleep(0.002)
        assert not rd.has_ring()
        assert rd.publish_count() == 0
        assert rd.min_slot_count() is None
        # The dead writer's records are still exactly their own keys' records.
        for i in range(3):
            assert_is_record_of(rd.lookup(key_for(i)), i, 8)

        # A restarted writer takes the name over at once, and counts immediately.
        w = make_writer(tmp_path, writer_id="proc")
        assert rd.has_ring()
        assert rd.epochs == {"ring-proc.bin": w.epoch}
        assert rd.lookup(key_for(0)) is None  # gone with the old file
        k = publish_index(w, 7)
        assert_is_record_of(rd.lookup(k), 7, 8)
        assert rd.publish_count() == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rd.close()
        if w is not None:
            w.close()


def test_dead_writer_file_is_readable_but_not_live(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    d = tmp_path / "rings"
    w = make_writer(d)
    k = publish_index(w, 0)
    r = RingReader.open(w.path)
    rd_live = RingDirectory(d)
    assert r.is_live()
    assert rd_live.has_ring()
    w.close()  # e.g. vLLM stopped; a container restart keeps the memory volume
    assert not r.is_live()
    assert not r.is_live()
    # The probe let go of its shared lock: an exclusive one is free.
    fd = os.open(w.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    r.close()
    assert not r.is_live()  # closed reader

    rd = RingDirectory(d)
    for _ in range(3):
        assert not rd.has_ring()
    assert rd.epochs == {"ring-dp0.bin": w.epoch}  # mapped ...
    assert_is_record_of(rd.lookup(k), 0, 8)  # ... and searchable
    assert rd.publish_count() == 0
    assert rd.min_slot_count() is None
    gone = [rec for rec in caplog.records if "is gone" in rec.getMessage()]
    assert len(gone) == 1  # for rd; rd_live has not probed since
    assert str(w.path) in gone[0].getMessage()

    time.sleep(RingDirectory.LIVENESS_INTERVAL + 0.02)
    assert not rd_live.has_ring()  # the cached "live" answer expired

    # A copy of a ring file (no writer ever held it) is not live either.
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    write_file(copy_dir / "ring-copy.bin", valid_ring_bytes(tmp_path))
    with RingDirectory(copy_dir) as rd_copy:
        assert set(rd_copy.epochs) == {"ring-copy.bin"}
        assert not rd_copy.has_ring()
    for obj in (rd, rd_live):
        obj.close()
    assert not rd.has_ring()  # closed


def test_reader_probes_do_not_make_create_fail(tmp_path: Path) -> None:
    make_writer(tmp_path).close()  # a dead writer's file, probed by a reader in a loop
    path = tmp_path / "ring-dp0.bin"
    stop = threading.Event()
    probes = {True: 0, False: 0}

    def probe() -> None:
        while not stop.is_set():
            try:
                r = RingReader.open(path)
            except RingFormatError:
                continue
            with r:
                for _ in range(100):
                    probes[r.is_live()] += 1

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        for i in range(40):
            w = make_writer(tmp_path)
            publish_index(w, i)
            w.close()
    finally:
        stop.set()
        thread.join()
    assert probes[False] > 0  # probed dead files (and so held shared locks) ...
    assert probes[True] > 0  # ... and live ones while creates were going on


def test_create_waits_out_a_brief_shared_lock(tmp_path: Path) -> None:
    old = make_writer(tmp_path)
    old.close()
    fd = os.open(old.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a slow reader probe, released after 50 ms
        timer = threading.Timer(0.05, fcntl.flock, (fd, fcntl.LOCK_UN))
        t0 = time.monotonic()
        timer.start()
        try:
            w = make_writer(tmp_path)
        finally:
            timer.join()
        assert time.monotonic() - t0 >= 0.05
    finally:
        os.close(fd)
    with RingReader.open(w.path) as r:
        assert r.epoch == w.epoch != old.epoch
    w.close()
    # A shared lock held longer than IN_USE_WAIT is indistinguishable from a live writer.
    fd = os.open(w.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        with pytest.raises(RingInUseError):
            make_writer(tmp_path)
    finally:
        os.close(fd)
    with RingReader.open(w.path) as r:
        assert r.epoch == w.epoch  # untouched


@pytest.mark.parametrize("existing", ["none", "dead", "dead-probed"])
def test_simultaneous_creators_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: str
) -> None:
    """Creators racing for one name: one wins, the others get RingInUseError.

    "dead-probed": a reader's shared lock on the dead file makes every creator wait on that
    same old file; once it is released, the first to lock it replaces it and the others must
    notice that the name now refers to the winner's (live) file.
    """
    if existing != "dead-probed":
        monkeypatch.setattr(ring, "IN_USE_WAIT", 0.02)

    def start(
        d: Path, barrier: threading.Barrier, results: list[RingWriter | RingInUseError]
    ) -> None:
        barrier.wait()
        try:
            results.append(make_writer(d))
        except RingInUseError as exc:
            results.append(exc)

    for round_ in range(3 if existing == "dead-probed" else 10):
        d = tmp_path / f"round{round_}"
        probe_fd = None
        if existing != "none":
            make_writer(d).close()
        if existing == "dead-probed":
            probe_fd = os.open(d / "ring-dp0.bin", os.O_RDONLY)
            fcntl.flock(probe_fd, fcntl.LOCK_SH)
        barrier = threading.Barrier(4)
        results: list[RingWriter | RingInUseError] = []
        threads = [threading.Thread(target=start, args=(d, barrier, results)) for _ in range(4)]
        for t in threads:
            t.start()
        if probe_fd is not None:
            time.sleep(0.05)  # well inside IN_USE_WAIT: all four are retrying on the old file
            os.close(probe_fd)
        for t in threads:
            t.join()
        winners = [x for x in results if isinstance(x, RingWriter)]
        assert len(results) == 4
        assert len(winners) == 1, results
        with RingReader.open(winners[0].path) as r:
            assert r.epoch == winners[0].epoch
            assert r.is_live()
        assert os.listdir(d) == ["ring-dp0.bin"]
        winners[0].close()


def test_publish_count_and_min_slot_count(tmp_path: Path) -> None:
    rd = RingDirectory(tmp_path)
    assert not rd.has_ring()
    assert rd.publish_count() == 0
    assert rd.min_slot_count() is None
    w1 = make_writer(tmp_path, slot_count=4, writer_id="dp0")
    w2 = make_writer(tmp_path, slot_count=8, writer_id="dp1")
    assert rd.has_ring()  # picks both up (as the proxy does before forwarding)
    assert rd.publish_count() == 0
    assert rd.min_slot_count() == 4
    for i in range(3):
        publish_index(w1, i)
    assert rd.publish_count() == 3
    for i in range(3, 14):  # 11 records: wraps w2's 8 slots
        publish_index(w2, i)
    assert rd.publish_count() == 14
    before = rd.publish_count()
    for i in range(14, 24):
        publish_index(w1, i)
        assert rd.publish_count() == before + i - 13
    assert rd.publish_count() == 24 == w1.publish_count + w2.publish_count

    w1.close()
    time.sleep(RingDirectory.LIVENESS_INTERVAL + 0.02)
    assert rd.has_ring()
    assert rd.publish_count() == 11  # only live rings count
    assert rd.min_slot_count() == 8
    w2.close()
    time.sleep(RingDirectory.LIVENESS_INTERVAL + 0.02)
    assert not rd.has_ring()
    assert rd.publish_count() == 0
    assert rd.min_slot_count() is None
    rd.close()
    assert rd.publish_count() == 0
    assert rd.min_slot_count() is None


def test_liveness_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = make_writer(tmp_path)
    rd = RingDirectory(tmp_path)
    probes = 0
    real_is_live = RingReader.is_live

    def counting_is_live(self: RingReader) -> bool:
        nonlocal probes
        probes += 1
        return real_is_live(self)

    monkeypatch.setattr(RingReader, "is_live", counting_is_live)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        assert rd.has_ring()
    elapsed = time.perf_counter() - t0
    assert 1 <= probes <= 1 + elapsed / RingDirectory.LIVENESS_INTERVAL + 1
    probes = 0
    publish_index(w, 0)
    assert rd.publish_count() == 1
    assert rd.min_slot_count() == 4
    assert probes == 0  # same cached answer
    time.sleep(RingDirectory.LIVENESS_INTERVAL + 0.02)
    assert rd.has_ring()
    assert probes == 1  # expired: probed again
    rd.close()
    w.close()


# ---------------------------------------------------------------------------------------------
# fuzzing: garbage never escapes as anything but RingFormatError
# ---------------------------------------------------------------------------------------------


def _check_garbage_file(directory: Path, data: bytes, keys: list[bytes]) -> None:
    path = directory / "ring-fuzz.bin"
    write_file(path, data)
    try:
        r = RingReader.open(path)
    except RingFormatError:
        r = None
    if r is not None:
        for k in keys:
            rec = r.lookup(k)
            if rec is not None:
                assert rec.key == k
                assert len(rec.vector) == 4 * rec.hidden_size
        r.close()
    rd = RingDirectory(directory)
    for k in keys:
        rec = rd.lookup(k)
        assert rec is None or rec.key == k
    rd.close()


_KEYS = st.lists(
    st.one_of(
        st.binary(min_size=REQUEST_KEY_BYTES, max_size=REQUEST_KEY_BYTES),
        st.binary(max_size=24),
        st.integers(0, 5).map(key_for),
    ),
    max_size=6,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.binary(max_size=2048), keys=_KEYS)
def test_fuzz_arbitrary_bytes(tmp_path: Path, data: bytes, keys: list[bytes]) -> None:
    _check_garbage_file(tmp_path, data, keys)
    # Same bytes behind a valid magic + version so the deeper checks are reached too.
    prefix = ring.MAGIC + struct.pack("<I", ring.LAYOUT_VERSION)
    _check_garbage_file(tmp_path, prefix + data, keys)


_VALID: dict[str, bytes] = {}


def _valid_fuzz_base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if "base" not in _VALID:
        _VALID["base"] = valid_ring_bytes(tmp_path_factory.mktemp("fuzzbase"), records=6)
    return _VALID["base"]


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    mutations=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8),
    header_u32=st.lists(
        st.tuples(st.integers(0, HEADER_SIZE // 4 - 1), st.integers(0, 0xFFFFFFFF)), max_size=2
    ),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
    keys=_KEYS,
)
def test_fuzz_mutated_valid_ring(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    mutations: list[tuple[int, int]],
    header_u32: list[tuple[int, int]],
    cut: int | None,
    keys: list[bytes],
) -> None:
    data = bytearray(_valid_fuzz_base(tmp_path_factory))
    for pos, value in mutations:
        data[pos % len(data)] = value
    for word, value in header_u32:
        struct.pack_into("<I", data, 4 * word, value)
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    _check_garbage_file(tmp_path, bytes(data), keys)


def test_fuzz_base_is_readable(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """The unmutated fuzz base must really be a ring with records in it (fuzzing is not vacuous)."""
    path = tmp_path / "ring-base.bin"
    write_file(path, _valid_fuzz_base(tmp_path_factory))
    with RingReader.open(path) as r:
        assert r.lookup(key_for(0)) is None  # overwritten (4 slots, 6 records)
        for i in range(2, 6):
            assert_is_record_of(r.lookup(key_for(i)), i, 8)


FORKING_HOLDER_SCRIPT = r"""
import os, sys, time
from vllm_hidden_state_proxy.ring import RingWriter

w = RingWriter.create(sys.argv[1], writer_id="proc", hidden_size=8, model="m", slot_count=4)
child = os.fork()  # like vLLM's compile workers: forked after the ring exists
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""


def test_a_forked_child_does_not_keep_a_dead_writers_ring_alive(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    rd = RingDirectory(tmp_path)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert rd.has_ring()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        died = time.monotonic()
        while rd.has_ring():
            assert time.monotonic() - died < RingDirectory.LIVENESS_INTERVAL + 0.5
            time.sleep(0.002)
        os.kill(child, 0)  # the forked child is still running, yet the ring is not live
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        rd.close()
