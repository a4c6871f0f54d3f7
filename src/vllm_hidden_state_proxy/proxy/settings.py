"""Proxy configuration: one frozen value object, built once by the caller (CLI, tests)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm_hidden_state_proxy.protocol import ring_dir_from_env
from vllm_hidden_state_proxy.proxy.embeddings_request import DEFAULT_TEMPLATE, check_template

MIB = 1024 * 1024


def default_ring_owners() -> tuple[int, ...]:
    return tuple(sorted({os.getuid(), 0}))


@dataclass(frozen=True)
class ProxySettings:
    """Everything the proxy needs to know; no other module reads the environment."""

    #: Base URL of vLLM's OpenAI server, e.g. ``http://127.0.0.1:8000`` (no trailing path needed).
    upstream_url: str
    #: Directory holding the worker hook's shared-memory rings (same as vLLM's).
    ring_dir: str = field(default_factory=ring_dir_from_env)
    #: Users whose ring files the proxy trusts (a ring file owned by anyone else is refused);
    #: by default the proxy's own user and root.
    ring_owner_uids: tuple[int, ...] = field(default_factory=lambda: default_ring_owners())
    #: Seconds to wait, after vLLM answered 200, for the hidden state to show up in the ring.
    vector_timeout: float = 5.0
    #: Largest request body accepted (bytes); larger bodies get 413.
    max_body_bytes: int = 32 * MIB
    #: Size of the pooled connection set towards vLLM.
    max_connections: int = 1000
    #: Seconds to establish a TCP connection to vLLM.
    connect_timeout: float = 5.0
    #: Read/write timeout towards vLLM in seconds; ``None`` waits forever (long generations).
    request_timeout: float | None = None
    #: If set, clients must send ``Authorization: Bearer <api_key>`` (401 otherwise).
    api_key: str | None = None
    #: With ``api_key``: ``/metrics`` needs the key too (``/health`` never does).
    protect_metrics: bool = False
    #: Sent to vLLM as ``Authorization: Bearer ...`` instead of the client's header (when vLLM's
    #: own ``--api-key`` differs from the proxy's).
    upstream_api_key: str | None = None
    #: Seconds ``GET /health`` waits for vLLM's own ``/health``.
    health_timeout: float = 2.0
    #: Most upstream requests one client request fans out to at a time (a flagged list of
    #: completions prompts, embeddings inputs).
    fan_out_limit: int = 64
    #: ``/v1/embeddings``: the prompt template for text inputs (must contain ``{text}``).
    embedding_template: str = DEFAULT_TEMPLATE
    #: ``/v1/embeddings``: most inputs per request (more get 400).
    max_embedding_inputs: int = 2048

    def __post_init__(self) -> None:
        if not self.upstream_url.startswith(("http://", "https://")):
            raise ValueError(
                f"upstream_url must start with http:// or https://: {self.upstream_url!r}"
            )
        if self.vector_timeout < 0:
            raise ValueError("vector_timeout must be >= 0")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")
        check_template(self.embedding_template)
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None disables it)")
        if self.max_embedding_inputs <= 0:
            raise ValueError("max_embedding_inputs must be > 0")
        if self.fan_out_limit <= 0:
            raise ValueError("fan_out_limit must be > 0")
        if self.max_connections <= 0:
            raise ValueError("max_connections must be > 0")
        if self.connect_timeout <= 0 or self.health_timeout <= 0:
            raise ValueError("connect_timeout and health_timeout must be > 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0 or None")

    @property
    def timeouts(self) -> dict[str, float | None]:
        """httpx's per-request timeout extension for requests to vLLM."""
        return {
            "connect": self.connect_timeout,
            "read": self.request_timeout,
            "write": self.request_timeout,
            "pool": None,  # wait for a free connection; clients time out on their own
        }

    @property
    def upstream_base(self) -> str:
        """``upstream_url`` without a trailing slash, ready for ``base + path``."""
        return self.upstream_url.rstrip("/")
