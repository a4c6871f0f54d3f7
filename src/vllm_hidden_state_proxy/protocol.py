"""Names shared by the proxy and the worker hook: the wire contract between the two sides.

The proxy selects a request by adding ``{XARGS_KEY: <32 hex chars>}`` to the request's
``vllm_xargs``; vLLM hands it to the worker as ``SamplingParams.extra_args``. The worker hook
publishes the vector into the shared-memory ring under the 16 raw bytes of that key.
"""

from __future__ import annotations

import os
import secrets

#: Name of the entry in ``vllm_xargs`` / ``SamplingParams.extra_args`` that carries the key.
XARGS_KEY = "hidden_state_proxy_key"

#: Raw key length in bytes (128-bit random).
KEY_BYTES = 16

#: Directory holding the ring files (one per writer). Shared by vLLM and the proxy.
RING_DIR_ENV = "HIDDEN_STATE_PROXY_RING_DIR"
DEFAULT_RING_DIR = "/dev/shm/vllm-hidden-states"

#: Number of slots in a ring (writer side).
RING_SLOTS_ENV = "HIDDEN_STATE_PROXY_RING_SLOTS"
DEFAULT_RING_SLOTS = 1024

#: Set to "0" to keep the worker hook from wrapping the model runner.
HOOK_ENABLED_ENV = "HIDDEN_STATE_PROXY_HOOK"

#: Octal group-readable mode for the ring directory (e.g. "0750") when proxy and vLLM run as
#: different users in one group. Default: 0700 directory, 0600 files.
RING_DIR_MODE_ENV = "HIDDEN_STATE_PROXY_RING_DIR_MODE"


def ring_dir_from_env() -> str:
    return os.environ.get(RING_DIR_ENV) or DEFAULT_RING_DIR


def new_key() -> bytes:
    """A fresh 128-bit random key; never derived from client input."""
    return secrets.token_bytes(KEY_BYTES)


def key_to_wire(key: bytes) -> str:
    return key.hex()


def key_from_wire(value: object) -> bytes | None:
    """Parse the key from ``extra_args``; ``None`` if it is not a well-formed key."""
    if not isinstance(value, str) or len(value) != 2 * KEY_BYTES:
        return None
    try:
        key = bytes.fromhex(value)  # note: fromhex skips whitespace, hence the length check
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None
