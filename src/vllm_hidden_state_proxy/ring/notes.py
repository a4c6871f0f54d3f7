"""Failure notes: an engine whose worker hook could not start its ring says so, and why.

When an engine's hook fails to start (no space for its ring, an unsupported model runner, ...),
it writes ``ring-<instance>-dp<engine>.failed`` (a small JSON object) where its ring would be,
and holds an exclusive ``flock`` on it for its lifetime, exactly as a writer holds its ring: a
note is *live* while that engine's process is. A proxy that sees a live note knows that flagged
requests routed to that engine cannot get vectors, names the engine and the cause in its answer
at once (instead of waiting out the vector timeout), and reports it in ``/metrics`` and, when
other engines of the same vLLM do publish, in ``/health``.

A note that says ``refused_settings`` is the hook refusing what the operator configured (layers
the model cannot return, say), not a hook that is merely off. A note that says ``fatal`` is one
that will not go away by itself: refused settings, a vLLM that lacks what the hook reads, or any
failure of a hook the operator required. ``serve`` stops at startup on a fatal note of its own
vLLM, and a proxy with no live ring is not ready while one lives. (A note without ``fatal``, as
older hooks wrote them, is fatal when it says ``refused_settings``.)
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vllm_hidden_state_proxy.ring.files import (
    NOTE_SUFFIX,
    PRIVATE_MODES,
    Owners,
    Untrusted,
    create_directory,
    files_named,
    forget_in_forked_children,
    install,
    new_locked_temp,
    note_name,
    open_trusted,
    writer_alive,
)

#: Largest note a reader accepts.
MAX_NOTE_BYTES = 16384


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """A live note: which engine of which vLLM instance has no ring, and why."""

    instance: int
    engine: int
    pid: int
    message: str
    #: The hook refused the server's own settings.
    refused_settings: bool = False
    #: The hook will not start on this engine until the operator acts (``serve`` exits,
    #: ``/health`` is 503 while no ring is live): implied by ``refused_settings``.
    fatal: bool = False

    def __post_init__(self) -> None:
        if self.refused_settings and not self.fatal:
            object.__setattr__(self, "fatal", True)

    def summary(self) -> str:
        """In words only (no pid, path or exception text): for whoever asks ``/health``."""
        if self.refused_settings:
            return (
                f"the worker hook of engine {self.engine} (data-parallel index) refused the "
                "settings vLLM was started with"
            )
        if self.fatal:  # an incompatible vLLM, or a hook the operator required
            return (
                f"engine {self.engine} (data-parallel index) has no ring: its worker hook "
                "cannot run there until vLLM is restarted or changed"
            )
        return (
            f"engine {self.engine} (data-parallel index) has no ring: its worker hook could "
            "not start"
        )

    def describe(self) -> str:
        return (
            f"engine {self.engine} (data-parallel index) of vLLM instance {self.instance:016x}, "
            f"pid {self.pid}: its worker hook could not start: {self.message}"
        )


class FailureNote:
    """The note an engine holds while it lives (written by the hook's process)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        forget_in_forked_children(self)

    @classmethod
    def write(
        cls,
        directory: str | os.PathLike[str],
        *,
        instance: int,
        engine: int,
        message: str,
        refused_settings: bool = False,
        fatal: bool = False,
        dir_mode: int = PRIVATE_MODES[0],
        file_mode: int = PRIVATE_MODES[1],
    ) -> FailureNote:
        d = Path(directory)
        create_directory(d, dir_mode)
        final = d / note_name(instance, engine)
        body = json.dumps(
            {
                "instance": instance,
                "engine": engine,
                "pid": os.getpid(),
                "message": message[:4000],
                "refused_settings": refused_settings,
                "fatal": fatal or refused_settings,
            }
        ).encode("utf-8")
        fd, tmp_name = new_locked_temp(d, final.stem, file_mode)
        try:
            os.write(fd, body)
            install(tmp_name, final)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        return cls(final, fd)

    def forget_after_fork(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Release the note (it stays on disk, no longer live) and remove it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(fd)


def read_live_note(path: Path, owner_uids: Owners) -> EngineFailure | None:
    """The note at ``path`` if it is trusted, well-formed and its engine's process lives."""
    try:
        fd, st = open_trusted(path, owner_uids)
    except Untrusted:
        return None
    try:
        if st.st_size > MAX_NOTE_BYTES or not writer_alive(fd):
            return None
        try:
            document = json.loads(os.pread(fd, MAX_NOTE_BYTES, 0))
        except (OSError, ValueError):
            return None
    finally:
        os.close(fd)
    if not isinstance(document, dict):
        return None
    instance, engine = document.get("instance"), document.get("engine")
    pid, message = document.get("pid"), document.get("message")
    refused = document.get("refused_settings", False)
    fatal = document.get("fatal", refused)
    if not (
        type(instance) is int
        and type(engine) is int
        and type(pid) is int
        and type(message) is str
        and type(refused) is bool
        and type(fatal) is bool
    ):
        return None
    return EngineFailure(instance, engine, pid, message, refused, fatal)


def live_notes(directory: Path, owner_uids: Owners = None) -> list[EngineFailure]:
    """Every live note in ``directory``, read quietly (no log lines: ``serve`` asks this about
    its own vLLM, whose output shares its log)."""
    failures = (read_live_note(path, owner_uids) for path, _ in files_named(directory, NOTE_SUFFIX))
    return [failure for failure in failures if failure is not None]
