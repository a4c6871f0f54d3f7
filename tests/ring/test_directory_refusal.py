"""The proxy's side of the ring directory's own checks (ring/directory.py): a refused directory
is not read at all, says why once, and is read again once it is fixed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.ring.helpers import LOGGER, assert_is_record_of, key_for, make_writer, publish_index
from vllm_hidden_state_proxy.ring import FailureNote, RingDirectory, RingWriter

NOBODY = 65534


def following(directory: Path, **options: object) -> RingDirectory:
    """A directory that notices every change at once (no rate limits)."""
    rings = RingDirectory(directory, **options)  # type: ignore[arg-type]
    rings.CHECK_INTERVAL = 0.0
    rings.LIVENESS_INTERVAL = 0.0
    rings.refresh()
    return rings


def _published(directory: Path) -> RingWriter:
    writer = make_writer(directory)
    publish_index(writer, 0)
    return writer


def test_a_world_writable_directory_is_not_read_until_fixed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    writer = _published(tmp_path)
    try:
        os.chmod(tmp_path, 0o777)
        with following(tmp_path) as rings:
            assert rings.lookup(key_for(0)) is None
            assert not rings.has_ring() and rings.live_ring_count() == 0
            refusal = rings.refusal()
            assert refusal is not None and "writable by every user" in refusal
            assert str(tmp_path) in refusal
            for _ in range(3):  # every later look checks again, and logs nothing new
                rings.has_ring()
            refused = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert [r.getMessage() for r in refused] == [
                f"refusing {refusal} (checked again until it passes)"
            ]
            os.chmod(tmp_path, 0o755)
            assert rings.has_ring()
            assert rings.refusal() is None
            assert_is_record_of(rings.lookup(key_for(0)), 0)
        assert any("passes its checks now" in r.getMessage() for r in caplog.records)
    finally:
        writer.close()


def test_a_directory_that_turns_world_writable_is_dropped(tmp_path: Path) -> None:
    writer = _published(tmp_path)
    try:
        with following(tmp_path) as rings:
            assert rings.has_ring()
            assert_is_record_of(rings.lookup(key_for(0)), 0)
            os.chmod(tmp_path, 0o1777)  # no file changed: the liveness probe notices
            assert rings.live_ring_count() == 0
            assert "/tmp-like" in (rings.refusal() or "")
            assert rings.lookup(key_for(0)) is None
    finally:
        writer.close()


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    writer = _published(real)
    try:
        with following(tmp_path / "link") as missing:
            assert missing.refusal() is None  # nothing there yet: no hook made it, no refusal
        (tmp_path / "link").symlink_to(real)
        with following(tmp_path / "link") as rings:
            assert not rings.has_ring()
            assert "is a symbolic link" in (rings.refusal() or "")
    finally:
        writer.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_of_an_untrusted_user_is_refused_notes_included(tmp_path: Path) -> None:
    """Its owner could have put anything there, failure notes included: none is read."""
    directory = tmp_path / "rings"
    directory.mkdir(mode=0o700)
    note = FailureNote.write(directory, instance=1, engine=0, message="boom")
    writer = _published(directory)
    try:
        os.chown(directory, NOBODY, -1)
        with following(directory, owner_uids=(NOBODY + 1,)) as rings:
            assert not rings.has_ring()
            assert rings.failed_engines() == ()
            assert f"owned by uid {NOBODY}" in (rings.refusal() or "")
        with following(directory, owner_uids=None) as anyone:  # None: trust every owner
            assert anyone.has_ring()
        with following(directory, owner_uids=(NOBODY,)) as trusting:  # the operator said so
            assert trusting.refusal() is None
    finally:
        writer.close()
        note.close()


def test_root_and_this_user_may_own_the_directory_whoever_owns_the_rings(
    tmp_path: Path,
) -> None:
    """``--ring-owner-uids`` names the rings' owners; the directory may also be this user's or
    root's, who could change what this process reads anyway."""
    writer = _published(tmp_path)
    try:
        with following(tmp_path, owner_uids=(4242,)) as rings:
            assert rings.refusal() is None
    finally:
        writer.close()
