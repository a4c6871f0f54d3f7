"""What the proxy and the worker hook agree on: names, environment variables, the request key.

Vocabulary (one word per concept, used in code, docs and messages):

- **reply**: vLLM's HTTP response to one request the proxy sent it (status, headers, a JSON
  body or an event stream). The proxy relays it, or joins vectors into it.
- **answer**: what vLLM generates for one choice of a request (its tokens); the answer's
  vectors are taken from it (poolings ``"last_answer"``, ``"all_answer"``). Never vLLM's reply.
  (The option ``--max-answer-size`` and the error texts that say "vLLM's answer" keep the
  words users already have: they bound and name vLLM's reply.)
- **request key**: the fresh 128-bit random token the proxy gives one flagged request. It
  travels to vLLM as the ``vllm_xargs`` entry :data:`REQUEST_KEY_ENTRY` (32 hex characters),
  reaches the worker as ``SamplingParams.extra_args``, and is what a record is found by. Never
  derived from client input. (The *API key* is the unrelated client credential.)
- **engine**: one vLLM engine core (one data-parallel rank, ``data_parallel_index``); it has
  one publishing worker. **instance**: one vLLM server, i.e. the engines started together.
- **ring**: one shared-memory file per engine, written by its worker hook, read by proxies.
- **record**: what the hook publishes for one request key: its vectors and where they were
  taken, or the reason there are none (an error record).
- **vector**: ``hidden_size`` float32 values: one layer's state, at the last prompt position
  (pooling ``"last"``), averaged over every prompt position (pooling ``"mean"``), or at the
  last computed position of one generated answer (pooling ``"last_answer"``: the state that
  chose the answer's final token, see :func:`answer_key`).
- **matrix**: one row per position instead of one vector, per layer: every prompt position
  (pooling ``"all_prompt"``) or, for each generated answer, the state that chose each of its
  tokens (``"all_answer"``). Variable in size, it travels through the ring's **arena**.
- **choice**: one of the ``n`` generated answers of a request (vLLM's ``choices[i].index``).
- **layer**: an index into Transformers' ``output_hidden_states``: 0 is the embeddings, ``k``
  the residual stream after ``k`` decoder layers, ``N`` (= ``num_hidden_layers``) and ``-1``
  the final layer after the final norm.

Code conventions that follow from it: fixed facts of one object (a ring's hidden size, its
slot count) are properties; anything read from live shared memory or the file system (publish
counters, which rings are live) is a method. This module imports nothing of the project.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import zlib
from collections.abc import Sequence

# -- the request key -------------------------------------------------------------------------

#: Prefix of every ``vllm_xargs`` entry the proxy owns (clients may not set any of them).
XARGS_PREFIX = "hidden_state_proxy_"
#: ``vllm_xargs`` entry carrying the request key (hex).
REQUEST_KEY_ENTRY = XARGS_PREFIX + "key"
#: ``vllm_xargs`` entry listing the layers a flagged request wants (absolute indices).
LAYERS_ENTRY = XARGS_PREFIX + "layers"
#: ``vllm_xargs`` entry naming the pooling a flagged request wants (one of :data:`POOLINGS`).
POOLING_ENTRY = XARGS_PREFIX + "pooling"
#: ``vllm_xargs`` entry with the request's ``n`` (sent with ``"last_answer"`` when ``n > 1``):
#: vLLM runs each choice as a child request ``"{index}_{parent id}"``
#: (``vllm/v1/engine/parallel_sampling.py``), which the hook reads the choice index from.
CHOICES_ENTRY = XARGS_PREFIX + "choices"
#: ``vllm_xargs`` entry with pooling ``"spans"``: the spans, flat: ``[start, end, start, end,
#: ...]`` (token positions of the prompt, ``end`` exclusive; vLLM's ``vllm_xargs`` values may
#: be lists of numbers or strings, not of lists).
SPANS_ENTRY = XARGS_PREFIX + "spans"

#: ``vllm_xargs`` entries of a flagged list of completions prompts sent as one request (all its
#: prompts share one ``extra_args``): the list's **base**, the ``request_id`` the proxy gives
#: vLLM (fresh, 32 hex characters, never the client's), and its prompt count. vLLM runs prompt
#: ``i`` as engine request ``"cmpl-{base}-{i}"`` plus ``"-"`` and 8 random hex characters
#: (unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), choice ``c`` of ``n > 1`` as
#: ``"{c}_"`` before that (``n``: :data:`CHOICES_ENTRY`); the hook parses the index from it
#: and publishes the prompt's record under :func:`prompt_key`.
LIST_BASE_ENTRY = XARGS_PREFIX + "list_base"
LIST_SIZE_ENTRY = XARGS_PREFIX + "list_size"
#: The list's form, how vLLM names its items: ``"cmpl"`` (completions prompts, the default:
#: ``"cmpl-{base}-{i}"``) or ``"chatcmpl"`` (the conversations of ``/v1/chat/completions/batch``:
#: ``"chatcmpl-{base}_{i}"``), either followed by the random suffix.
LIST_FORM_ENTRY = XARGS_PREFIX + "list_form"
#: The list forms: each one's prefix before the base and separator before the index.
LIST_FORMS = {"cmpl": "-", "chatcmpl": "_"}
#: With a list of token-id prompts: each prompt's token count and
#: :func:`token_ids_checksum`, which the hook checks against the engine request's prompt.
LIST_TOKENS_ENTRY = XARGS_PREFIX + "list_tokens"
LIST_CHECKSUMS_ENTRY = XARGS_PREFIX + "list_checksums"
#: The longest prompt list sent as one request (the proxy's ``--max-prompts`` is below it).
MAX_LIST_SIZE = 1_000_000

#: Request key length in bytes (128-bit random).
REQUEST_KEY_BYTES = 16

#: The poolings a client asks for. ``"last"``, ``"mean"`` and ``"all_prompt"`` are of the
#: prompt (one record per request key); ``"last_answer"`` and ``"all_answer"`` of each choice's
#: answer (records under :func:`answer_key` and :func:`all_answer_key`).
REQUESTED_POOLINGS = ("last", "mean", "last_answer", "all_prompt", "all_answer")
#: ``"mean"`` over given token spans of the prompt (the client's ``"mean"`` with spans): one
#: row per span, a matrix. Sent with :data:`SPANS_ENTRY`.
SPANS_POOLING = "spans"
#: The poolings a record (and the pooling entry) can hold.
POOLINGS = (*REQUESTED_POOLINGS, SPANS_POOLING)
#: The poolings of one vector per layer of the prompt (all that ``/v1/embeddings`` can do).
PROMPT_POOLINGS = ("last", "mean")
#: The poolings that are taken from the generated answer, once it is finished.
ANSWER_POOLINGS = ("last_answer", "all_answer")
#: The poolings whose records hold one row per position (a matrix per layer), in the arena.
MATRIX_POOLINGS = ("all_prompt", "all_answer", SPANS_POOLING)
#: The poolings that need every prompt position computed (the prefix cache would skip some):
#: the proxy sends them with a fresh ``cache_salt``.
EVERY_PROMPT_POSITION = ("mean", "all_prompt", SPANS_POOLING)
#: The most spans one request may name.
MAX_SPANS = 1024

#: How many of a choice's latest computed positions the hook publishes when it finishes, each
#: as a record under :func:`answer_key`. The hook cannot tell which computed position chose
#: the final token: with async scheduling (and pipeline parallel batch queues) vLLM has already
#: computed a step past it when the stop is seen, and a ``stop`` string is found in vLLM's
#: front end, whose abort reaches the engine a few steps later. The proxy knows the answer's
#: token count and looks up the one it needs. (Each finished choice takes this many ring slots.)
ANSWER_WINDOW = 8

# -- the client's fields ----------------------------------------------------------------------
# What a client writes and reads: the proxy checks and answers them, ``client.py`` builds and
# decodes them (with numpy alone, which is why they live here and not in ``proxy/``).

KV = "kv_transfer_params"
XARGS = "vllm_xargs"
#: In the request, inside ``kv_transfer_params``.
FLAG = "return_last_hidden_state"
FORMAT = "last_hidden_state_format"
LAYERS = "last_hidden_state_layers"
POOLING = "last_hidden_state_pooling"
#: In the request (true asks for it) and in the answer (where and what the vectors are).
INFO = "last_hidden_state_info"
#: The float type of base64 values: the captured float32, or rounded to 16 bits.
DTYPE = "last_hidden_state_dtype"
#: Token spans of the prompt, each mean-pooled (pooling ``"mean"``).
SPANS = "last_hidden_state_spans"
#: The client-facing fields the proxy owns inside ``kv_transfer_params`` (stripped before vLLM).
OWN_FIELDS = (FLAG, FORMAT, INFO, LAYERS, POOLING, DTYPE, SPANS)
FORMATS = ("float", "base64")
DTYPES = ("float32", "float16", "bfloat16")

#: In the answer, inside ``kv_transfer_params``; a list of prompts gets the plurals.
VECTOR = "last_hidden_state"
VECTORS = "last_hidden_states"
BY_LAYER = "last_hidden_states_by_layer"
INFOS = "last_hidden_state_infos"

#: The most layers a server can capture (and so a request may name): the ring header's bound.
MAX_LAYERS = 1024
#: The largest token position a span may name (vLLM's contexts are far shorter).
MAX_SPAN_POSITION = 1 << 31

#: ``GET``: what the server captures and the limits of a request (the proxy's capture endpoint).
CAPTURE_PATH = "/v1/hidden_states"
#: vLLM's routes the proxy builds requests for itself (an embeddings input, a prompt of a list
#: sent again alone).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# -- the embeddings template -----------------------------------------------------------------
# The proxy's /v1/embeddings option, and the clients that build its prompts themselves (the
# benchmark, the tests' references).

#: Where a ``/v1/embeddings`` prompt template takes the text.
PLACEHOLDER = "{text}"
#: PromptEOL-style (Jiang et al., 2023): ask for a one-word summary, so that the state predicting
#: the answer's first token has to carry the meaning of the whole text.
DEFAULT_TEMPLATE = 'This sentence: "{text}" means in one word:'

# -- environment variables -------------------------------------------------------------------
# Deliberately not VLLM_*: vLLM warns about every VLLM_* variable it does not know.

# The hook's variables: their defaults, parsers and help are its settings table
# (worker_hook/settings.py); the proxy's, its options table (proxy/settings.py).

#: Directory holding the rings (one file per engine). Read by the hook and the proxy, whose
#: defaults must agree.
RING_DIR_ENV = "HIDDEN_STATE_PROXY_RING_DIR"
DEFAULT_RING_DIR = "/dev/shm/vllm-hidden-states"
#: Slots per ring (hook).
RING_SLOTS_ENV = "HIDDEN_STATE_PROXY_RING_SLOTS"
#: MiB of each ring's arena, where matrices travel (hook; 0: no matrices).
ARENA_MIB_ENV = "HIDDEN_STATE_PROXY_ARENA_MIB"
#: MiB one request's matrix record may take (hook; also in the ring header for the proxy).
MAX_RECORD_MIB_ENV = "HIDDEN_STATE_PROXY_MAX_RECORD_MIB"
#: MiB of device memory the hook may keep across steps for the requests in flight (hook).
DEVICE_MIB_ENV = "HIDDEN_STATE_PROXY_DEVICE_MIB"
#: Octal mode of the ring directory when proxy and vLLM run as different users (hook).
RING_DIR_MODE_ENV = "HIDDEN_STATE_PROXY_RING_DIR_MODE"
#: Seconds the hook waits for the ring directory's lock (hook).
RING_LOCK_TIMEOUT_ENV = "HIDDEN_STATE_PROXY_RING_LOCK_TIMEOUT"
#: Whether the hook wraps the model runner: off, auto or required (hook).
HOOK_ENABLED_ENV = "HIDDEN_STATE_PROXY_HOOK"
#: The layers the hook captures, e.g. "4,8,-1" (hook; ``serve --hidden-state-layers``).
LAYERS_ENV = "HIDDEN_STATE_PROXY_LAYERS"
#: The proxy's API key (clients send it as a Bearer token).
API_KEY_ENV = "HIDDEN_STATE_PROXY_API_KEY"
#: vLLM's own API key, when it differs from the proxy's.
UPSTREAM_API_KEY_ENV = "HIDDEN_STATE_PROXY_UPSTREAM_API_KEY"
#: The proxy's ``/v1/embeddings`` prompt template.
EMBEDDING_TEMPLATE_ENV = "HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE"
#: Seconds the proxy lets requests in flight finish after SIGTERM.
DRAIN_TIMEOUT_ENV = "HIDDEN_STATE_PROXY_DRAIN_TIMEOUT"
#: Seconds the proxy's ``/metrics`` waits for vLLM's.
METRICS_UPSTREAM_TIMEOUT_ENV = "HIDDEN_STATE_PROXY_METRICS_UPSTREAM_TIMEOUT"
#: Internal, from the proxy's server to its worker processes (``--workers``): the settings as
#: JSON, and the shared-memory file of their metrics.
WORKER_SETTINGS_ENV = "HIDDEN_STATE_PROXY_WORKER_SETTINGS"
WORKER_METRICS_ENV = "HIDDEN_STATE_PROXY_WORKER_METRICS"
#: Where the built-in tiny model is built and cached (``make demo``, the tests, the bench).
TINY_MODEL_DIR_ENV = "HIDDEN_STATE_PROXY_TINY_MODEL_DIR"
#: vLLM's own variable for its ``--api-key``; the proxy's key when the proxy's own variable is
#: unset (``VLLM_API_KEY=... vllm serve`` moved to ``serve`` keeps its key).
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: vLLM's own variable naming the general plugins it loads (all, when unset), and the hook's
#: name among them (its ``vllm.general_plugins`` entry point in pyproject.toml).
VLLM_PLUGINS_ENV = "VLLM_PLUGINS"
PLUGIN_NAME = "hidden_state_hook"

# -- layers ------------------------------------------------------------------------------------


def layer_indices(text: str) -> tuple[int, ...]:
    """The layers of a comma-separated list such as ``"4,8,-1"``, in order; empty items are
    skipped, so ``""`` is ``()``. Raises ``ValueError`` naming the first item that is not an
    integer."""
    layers = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            layers.append(int(part))
        except ValueError:
            raise ValueError(f"{part!r} is not a layer index (expected e.g. 4,8,-1)") from None
    return tuple(layers)


def absolute_layer(layer: int, final: int) -> int | None:
    """``layer`` as an index ``0..final`` of a model with ``final`` decoder layers (negative
    indices count from the end: ``-1`` is ``final``); ``None`` if it is out of range."""
    absolute = layer + final + 1 if layer < 0 else layer
    return absolute if 0 <= absolute <= final else None


def new_request_key() -> bytes:
    """A fresh 128-bit random request key; never derived from client input."""
    return secrets.token_bytes(REQUEST_KEY_BYTES)


def answer_key(key: bytes, choice: int, num_output_tokens: int) -> bytes:
    """The record key of the state that chose output token ``num_output_tokens`` (1-based) of
    choice ``choice`` of the request keyed ``key``: its position is
    ``num_prompt_tokens + num_output_tokens - 2`` (for the first token, the last prompt
    position). Unguessable without ``key``, distinct per (choice, count)."""
    data = struct.pack("<QQ", choice, num_output_tokens)
    return hashlib.blake2b(
        data, key=key, digest_size=REQUEST_KEY_BYTES, person=b"hsp-answer"
    ).digest()


def prompt_key(key: bytes, index: int) -> bytes:
    """The request key of prompt ``index`` of a list sent as one request keyed ``key``: its
    records are found by it as a single prompt's by its request key (an answer's:
    :func:`answer_key` of it). Unguessable without ``key``, distinct per index."""
    return hashlib.blake2b(
        struct.pack("<Q", index), key=key, digest_size=REQUEST_KEY_BYTES, person=b"hsp-prompt"
    ).digest()


def token_ids_checksum(token_ids: Sequence[int]) -> int:
    """CRC-32 of a prompt's token ids (each modulo 2**64, 8 bytes little-endian): what the
    proxy sends for each prompt of a token-id list and the hook checks, so that a prompt's
    record is never another prompt's."""
    crc = 0
    for start in range(0, len(token_ids), 4096):
        chunk = token_ids[start : start + 4096]
        packed = struct.pack(f"<{len(chunk)}Q", *(int(i) & 0xFFFF_FFFF_FFFF_FFFF for i in chunk))
        crc = zlib.crc32(packed, crc)
    return crc


def all_answer_key(key: bytes, choice: int) -> bytes:
    """The record key of choice ``choice``'s matrix (pooling ``"all_answer"``): the answer
    key of no token, which no ``"last_answer"`` record uses."""
    return answer_key(key, choice, 0)


def request_key_to_wire(key: bytes) -> str:
    return key.hex()


def request_key_from_wire(value: object) -> bytes | None:
    """Parse a request key from ``extra_args``; ``None`` if it is not a well-formed key."""
    if not isinstance(value, str) or len(value) != 2 * REQUEST_KEY_BYTES:
        return None
    try:
        key = bytes.fromhex(value)  # note: fromhex skips whitespace, hence the length check
    except ValueError:
        return None
    return key if len(key) == REQUEST_KEY_BYTES else None
