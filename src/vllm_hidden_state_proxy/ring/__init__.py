"""Shared-memory rings of hidden-state records: one file per engine, many readers.

The vLLM worker hook (:class:`RingWriter`) publishes each flagged request's record into a
fixed-size slot of a memory-mapped file; the proxy (:class:`RingDirectory`, every ring of a
directory) finds it by its request key. The writer never waits for readers: slots are reused in
FIFO order, and a per-slot seqlock, a CRC and two key checks let a reader prove that what it
copied is the requested record.

- :mod:`.layout`: the byte ruler, constants, header validation, record coding;
- :mod:`.files`: names, trust, locks and liveness, shared by rings and failure notes;
- :mod:`.writer`: create a ring and publish into it (the hook);
- :mod:`.notes`: an engine whose hook could not start says so (the hook), and why;
- :mod:`.reader`: one ring file, read-only (the proxy);
- :mod:`.directory`: every ring and note of a directory (the proxy).
"""

from vllm_hidden_state_proxy.protocol import MAX_LAYERS
from vllm_hidden_state_proxy.ring.directory import (
    PublishMarks,
    RingDirectory,
    RingDirectoryConflict,
    check_shareable,
)
from vllm_hidden_state_proxy.ring.files import Owners
from vllm_hidden_state_proxy.ring.layout import (
    LAYOUT_VERSION,
    RingFormatError,
    RingHeader,
    RingShape,
    slot_size_for,
)
from vllm_hidden_state_proxy.ring.notes import EngineFailure, FailureNote, live_notes
from vllm_hidden_state_proxy.ring.reader import PendingRows, RingReader
from vllm_hidden_state_proxy.ring.records import (
    PREFIX_GAP_STATUS,
    ErrorRecord,
    Found,
    Record,
)
from vllm_hidden_state_proxy.ring.writer import RingInUseError, RingWriter

__all__ = [
    "LAYOUT_VERSION",
    "MAX_LAYERS",
    "PREFIX_GAP_STATUS",
    "EngineFailure",
    "ErrorRecord",
    "FailureNote",
    "Found",
    "Owners",
    "PendingRows",
    "PublishMarks",
    "Record",
    "RingDirectory",
    "RingDirectoryConflict",
    "RingFormatError",
    "RingHeader",
    "RingInUseError",
    "RingReader",
    "RingShape",
    "RingWriter",
    "check_shareable",
    "live_notes",
    "slot_size_for",
]
