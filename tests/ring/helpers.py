"""Helpers shared by the ring tests: keys and vectors derived from a number, writers, files.

Keys and vectors are derived deterministically from an index (``key_for(i)``), so a writer in
another process (see :data:`SCRIPT_HEADER`) publishes exactly what a test expects.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from vllm_hidden_state_proxy.ring import Found, Record, RingWriter
from vllm_hidden_state_proxy.ring.layout import (
    KEY_BYTES,
    LAYOUT_VERSION,
    VERSION,
    RingHeader,
    RingShape,
    pack_header,
    slot_size_for,
)

LOGGER = "vllm_hidden_state_proxy.ring"
MODEL = "test/model-7b"
HIDDEN = 8
REPO = Path(__file__).resolve().parents[2]
#: ``nobody``: another user, for directories the checks must refuse.
NOBODY_UID = 65534


def key_for(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def vector_for(key: bytes, hidden_size: int, layer: int) -> bytes:
    """One layer's vector for ``key``: ``4 * hidden_size`` bytes, different per layer."""
    seed = hashlib.blake2b(key + layer.to_bytes(4, "little"), digest_size=16).digest()
    return (seed * (hidden_size // 4 + 1))[: 4 * hidden_size]


def vectors_for(key: bytes, hidden_size: int, layers: Sequence[int]) -> bytes:
    return b"".join(vector_for(key, hidden_size, layer) for layer in layers)


def make_writer(
    directory: str | os.PathLike[str],
    layers: Sequence[int] | None = None,
    *,
    hidden_size: int = HIDDEN,
    slot_count: int = 4,
    instance: int = 0,
    engine: int = 0,
    num_hidden_layers: int = 1,
    model: str = MODEL,
    runner: str = "",
    arena_size: int = 0,
    max_record: int | None = None,
) -> RingWriter:
    """A real ring, as the worker hook creates it; ``layers`` default to the final one. The
    ring tests' and, with their fake model's shape, the proxy tests' (``fakes.create_writer``)."""
    return RingWriter.create(
        directory,
        hidden_size=hidden_size,
        model=model,
        slot_count=slot_count,
        instance=instance,
        engine=engine,
        num_hidden_layers=num_hidden_layers,
        layers=layers,
        runner=runner,
        arena_size=arena_size,
        max_record=max_record,
    )


def publish_index(
    writer: RingWriter, i: int, *, layers: Sequence[int] | None = None, pooling: str = "last"
) -> bytes:
    """Publish record number ``i`` (key, vectors, position derived from ``i``); its key."""
    key = key_for(i)
    taken = (writer.shape.num_hidden_layers,) if layers is None else tuple(layers)
    writer.publish(
        key,
        vectors_for(key, writer.hidden_size, taken),
        position=i,
        num_prompt_tokens=i + 1,
        layers=layers,
        pooling=pooling,
    )
    return key


def record_of(
    i: int,
    *,
    hidden_size: int = HIDDEN,
    layers: Sequence[int] = (1,),
    pooling: str = "last",
    model: str = MODEL,
) -> Record:
    """The record :func:`publish_index` publishes for ``i``."""
    key = key_for(i)
    return Record(
        key=key,
        model=model,
        position=i,
        num_prompt_tokens=i + 1,
        pooling=pooling,
        layers=tuple(layers),
        hidden_size=hidden_size,
        vectors=vectors_for(key, hidden_size, layers),
    )


def assert_is_record_of(
    found: Found | None,
    i: int,
    *,
    hidden_size: int = HIDDEN,
    layers: Sequence[int] = (1,),
    pooling: str = "last",
) -> None:
    assert found == record_of(i, hidden_size=hidden_size, layers=layers, pooling=pooling)


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Put ``data`` at ``path`` atomically, with ``mode`` (the umask does not apply)."""
    tmp = path.with_name("." + path.name + ".new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def valid_ring_bytes(directory: Path, *, records: int = 3, hidden_size: int = HIDDEN) -> bytes:
    """The bytes of a ring (4 slots) with ``records`` records, its file removed."""
    writer = make_writer(directory, hidden_size=hidden_size, instance=0xDEAD)
    for i in range(records):
        publish_index(writer, i)
    writer.close()
    data = writer.path.read_bytes()
    writer.path.unlink()
    return data


def ready_header(shape: RingShape, *, epoch: int = 1, pid: int = 1, engine: int = 0) -> bytes:
    """A header as the writer leaves it once the file is ready (layout version set)."""
    raw = bytearray(pack_header(RingHeader(shape, epoch, pid, engine, instance=7)))
    VERSION.pack_into(raw, 8, LAYOUT_VERSION)
    return bytes(raw)


def shape_for(
    slot_count: int = 4,
    hidden_size: int = HIDDEN,
    layers: tuple[int, ...] = (1,),
    num_hidden_layers: int = 1,
) -> RingShape:
    slot_size = slot_size_for(hidden_size, len(layers), MODEL)
    return RingShape(slot_count, slot_size, hidden_size, num_hidden_layers, layers)


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds; ``timeout`` only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# ---------------------------------------------------------------------------------------------
# writers in other processes
# ---------------------------------------------------------------------------------------------

#: Prepended to every script run with :func:`python_script`.
SCRIPT_HEADER = """
import os, sys, time
from pathlib import Path
from vllm_hidden_state_proxy.ring import FailureNote, RingWriter
from tests.ring.helpers import key_for, make_writer, publish_index
"""


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


@contextlib.contextmanager
def python_script(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """Run ``SCRIPT_HEADER + script`` in a child process (stdin and stdout are pipes); it is
    killed on the way out if it still runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT_HEADER + script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def read_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


_LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def directory_lock_held(directory: Path) -> Iterator[int]:
    """Another process holds ``directory``'s lock (as a local user could) while the block runs;
    yields its pid."""
    with subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            yield holder.pid
        finally:
            holder.kill()


def ring_dir_of(tmp_path: Path, case: str) -> Path:
    """``tmp_path / "rings"`` as a ring directory the hook would refuse: ``symlink``, ``sticky``
    (a shared /tmp-like one) or ``foreign`` (another user's; needs root); any other case a
    plain private directory (the caller may hold its lock)."""
    ring_dir = tmp_path / "rings"
    if case == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        ring_dir.symlink_to(tmp_path / "elsewhere")
        return ring_dir
    ring_dir.mkdir(mode=0o700)
    if case == "sticky":
        os.chmod(ring_dir, 0o1777)
    elif case == "foreign":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(ring_dir, NOBODY_UID, -1)
    return ring_dir
