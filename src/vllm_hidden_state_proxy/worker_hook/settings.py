"""The worker hook's settings: every ``HIDDEN_STATE_PROXY_*`` variable it reads in vLLM's
environment, with its default, parser and help, written once (:data:`HOOK_VARIABLES`).

The names are :mod:`~vllm_hidden_state_proxy.protocol`'s (``serve`` and the proxy name them
too); ``docs/api.md``'s table of the hook's environment is :func:`environment_table` (a test
keeps it equal), and ``serve`` checks its ``--ring-dir`` with the same :class:`HookSettings`.

A value is parsed when the hook asks for it, not when :class:`HookSettings` is made: a
malformed variable fails the step that needs it (the ring's creation, whose failure note names
the variable), exactly where the hook reads it, and never vLLM's startup as a whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from vllm_hidden_state_proxy.option_table import Option, markdown_table
from vllm_hidden_state_proxy.protocol import (
    ARENA_MIB_ENV,
    DEFAULT_RING_DIR,
    DEVICE_MIB_ENV,
    HOOK_ENABLED_ENV,
    LAYERS_ENV,
    MAX_RECORD_MIB_ENV,
    PLUGIN_NAME,
    RING_DIR_ENV,
    RING_DIR_MODE_ENV,
    RING_LOCK_TIMEOUT_ENV,
    RING_SLOTS_ENV,
    VLLM_PLUGINS_ENV,
)
from vllm_hidden_state_proxy.ring.files import PRIVATE_MODES, ring_modes

T = TypeVar("T")

HOOK_MODES = ("off", "auto", "on")
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def hook_mode(raw: str) -> str:
    """``"off"``, ``"on"`` (required) or ``"auto"`` for a ``HIDDEN_STATE_PROXY_HOOK`` value.

    An unknown value is ``"auto"``: the safe reading (the hook runs, as without the variable).
    """
    value = raw.strip().lower()
    if value in _OFF:
        return "off"
    if value in _ON:
        return "on"
    return "auto"


def lock_timeout(raw: str) -> float:
    """A ``HIDDEN_STATE_PROXY_RING_LOCK_TIMEOUT`` value; raises ``ValueError`` naming the
    variable if it is not a finite number of seconds >= 0."""
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{RING_LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds such as 30")
    return seconds


RING_DIR: Option[str] = Option(
    DEFAULT_RING_DIR,
    "ring directory (must match the proxy's)",
    str,
    env=RING_DIR_ENV,
)
#: The raw list: which layers it names depends on the model (``layers.parse_layers``).
LAYERS: Option[str | None] = Option(
    None,
    "the layers captured, e.g. `4,8,-1`",
    str,
    env=LAYERS_ENV,
    shown_default="(the final layer)",
)
RING_SLOTS: Option[int] = Option(
    1024,
    "slots per ring; one slot holds one request's record",
    int,
    env=RING_SLOTS_ENV,
)


def mebibytes(variable: str) -> Callable[[str], int]:
    """The parser of ``variable``, a size in MiB (an integer from 0 to 2**20), giving bytes;
    it raises ``ValueError`` naming the variable for anything else."""

    def parse(raw: str) -> int:
        text = raw.strip()
        if not text.isdigit() or int(text) > 1 << 20:
            raise ValueError(f"{variable}={raw!r} is not a size in MiB (an integer, e.g. 256)")
        return int(text) << 20

    return parse


def _mebibytes_option(default_mib: int, variable: str, help: str) -> Option[int]:
    """A size in MiB given by ``variable`` (:func:`mebibytes`), in bytes; its default shown in
    MiB."""
    return Option(
        default_mib << 20, help, mebibytes(variable), env=variable, shown_default=f"`{default_mib}`"
    )


ARENA: Option[int] = _mebibytes_option(
    256,
    ARENA_MIB_ENV,
    "MiB of each engine's arena, the part of its ring file that matrices travel through "
    "(poolings `all_prompt`, `all_answer`); reserved in the ring directory's file system at "
    "startup; also what the matrices being gathered in the worker may take together, each "
    "block's header and the tail left at a wrap counted (past it a request's record is an "
    "error: 503, never a matrix written over before it is published). `0`: no matrices",
)
MAX_RECORD: Option[int] = _mebibytes_option(
    64,
    MAX_RECORD_MIB_ENV,
    "MiB one request's matrix record may take in the arena: its block, a 64-byte header and "
    "rows x layers x hidden size x 4 bytes, padded to 64; past it the request is refused with a "
    "413 naming this variable, before any row is kept (at most the arena's size)",
)
DEVICE: Option[int] = _mebibytes_option(
    512,
    DEVICE_MIB_ENV,
    "MiB of device memory the hook may keep across steps for the requests in flight: "
    "`all_prompt` rows so far, `spans` sums (and one layer's running sum), the answers' kept "
    "rows, each counted at its most in float32 when the request is first seen; past it an error "
    "record naming this variable: 413 for one request alone, 503 for the requests together",
)
RING_DIR_MODE: Option[tuple[int, int]] = Option(
    PRIVATE_MODES,
    "e.g. `0750` (files `0640`) when the proxy runs as another user of the same group; `0770` "
    "also accepts a group-writable directory (a shared volume such as compose's and the chart's)",
    ring_modes,
    env=RING_DIR_MODE_ENV,
    shown_default="`0700` (files `0600`)",
)
RING_LOCK_TIMEOUT: Option[float] = Option(
    30.0,
    "seconds the hook waits for the ring directory's lock (other servers' hooks hold it only "
    "while adding their ring); then the engine has no ring, leaves a failure note naming the "
    "holder's pid, and `serve` exits 1",
    lock_timeout,
    env=RING_LOCK_TIMEOUT_ENV,
)
HOOK: Option[str] = Option(
    "auto",
    "`auto` (or unset, empty, or any other word): the hook runs wherever its startup checks "
    "pass (below); `0`/`false`/`no`/`off`: the hook wraps nothing (vLLM runs as without the "
    "package; no ring, no failure note); `1`/`true`/`yes`/`on`: the hook is *required*: as "
    "`auto`, and any failure to start its ring (not only refused settings or an incompatible "
    "vLLM) makes the failure note fatal. `serve` removes it from vLLM's environment (`auto`)",
    hook_mode,
    env=HOOK_ENABLED_ENV,
)

#: Every variable the hook reads, in the order the docs list them.
HOOK_VARIABLES: tuple[Option[Any], ...] = (
    RING_DIR,
    LAYERS,
    RING_SLOTS,
    ARENA,
    MAX_RECORD,
    DEVICE,
    RING_DIR_MODE,
    RING_LOCK_TIMEOUT,
    HOOK,
)

#: vLLM's own variable, which decides whether the hook is loaded at all (documented beside
#: the hook's own; the hook does not read it).
VLLM_PLUGINS: Option[str | None] = Option(
    None,
    f"if you set it, include `{PLUGIN_NAME}`",
    str,
    env=VLLM_PLUGINS_ENV,
    shown_default="(all plugins)",
)


class _Variable(Generic[T]):
    """An attribute of :class:`HookSettings`: its variable, read and parsed from the settings'
    ``environ`` each time it is asked for (``ValueError`` naming the variable if malformed)."""

    def __init__(self, option: Option[T]) -> None:
        self.option = option

    @overload
    def __get__(self, settings: None, owner: type[HookSettings]) -> _Variable[T]: ...

    @overload
    def __get__(self, settings: HookSettings, owner: type[HookSettings]) -> T: ...

    def __get__(self, settings: HookSettings | None, owner: type[HookSettings]) -> _Variable[T] | T:
        if settings is None:
            return self
        return self.option.read(settings.environ)


@dataclass(frozen=True)
class HookSettings:
    """The hook's settings in ``environ`` (by default this process's environment, as it is when
    a value is asked for); each attribute parses its variable then (see the module docstring)."""

    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)

    ring_dir = _Variable(RING_DIR)
    #: The layer list as given; ``None``: the final layer only.
    layers = _Variable(LAYERS)
    ring_slots = _Variable(RING_SLOTS)
    #: Bytes (as are the next two).
    arena_bytes = _Variable(ARENA)
    max_record_bytes = _Variable(MAX_RECORD)
    device_bytes = _Variable(DEVICE)
    #: (directory, file) modes.
    ring_modes = _Variable(RING_DIR_MODE)
    #: Seconds.
    ring_lock_timeout = _Variable(RING_LOCK_TIMEOUT)
    #: ``"off"``, ``"auto"`` or ``"on"`` (required).
    hook_mode = _Variable(HOOK)


def environment_table() -> str:
    """The Markdown table of the hook's environment (``docs/api.md`` carries it verbatim)."""
    return markdown_table((*HOOK_VARIABLES, VLLM_PLUGINS), ("variable", "default", "meaning"))
