"""The proxy's settings: one table, from which the CLI, ``serve``'s child command line and the
option table of docs/api.md are all built.

Each field of :class:`ProxySettings` is one fact: its name, type, default, and, for the ones a
user can set, an :class:`~vllm_hidden_state_proxy.option_table.Option` (the record ``serve``'s
and the hook's tables use too): the command-line flag, the environment variable that supplies
its default, and its help text. :func:`add_arguments` turns the table into ``argparse``
options, :func:`from_arguments` back into settings, :func:`command_line` and
:func:`secret_environment` into the ``hidden-state-proxy proxy`` child that ``serve`` starts
(secrets travel in the environment, never in the visible command line), and
:func:`options_table` into Markdown (a test keeps ``docs/api.md`` equal to it). The user's
environment variables are read when arguments are parsed (``Option.read``), and nowhere else in
the proxy; the worker processes of ``--workers N`` get the parsed settings from their server,
as JSON in ``WORKER_SETTINGS_ENV`` (:func:`ProxySettings.to_json`, read back in ``server.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy import option_table
from vllm_hidden_state_proxy.option_table import Option, option
from vllm_hidden_state_proxy.protocol import (
    API_KEY_ENV,
    DEFAULT_RING_DIR,
    DEFAULT_TEMPLATE,
    DRAIN_TIMEOUT_ENV,
    EMBEDDING_TEMPLATE_ENV,
    METRICS_UPSTREAM_TIMEOUT_ENV,
    PLACEHOLDER,
    PROMPT_POOLINGS,
    RING_DIR_ENV,
    UPSTREAM_API_KEY_ENV,
    VLLM_API_KEY_ENV,
)
from vllm_hidden_state_proxy.transport import ENGINES

KIB = 1024
MIB = 1024 * KIB
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOOPBACK = "127.0.0.1"
#: vLLM's default ``--host`` (it binds every interface).
ALL_INTERFACES = "0.0.0.0"


def _size_option(default: int, flag: str, help: str) -> Any:
    """A byte count's option: shown in help and docs as bytes and in KiB or MiB."""
    unit, name = (MIB, "MiB") if default % MIB == 0 else (KIB, "KiB")
    shown = f"{default} ({default // unit} {name})"
    return option(default, flag, help, metavar="BYTES", parse=int, shown_default=shown)


def check_template(template: str) -> str:
    """A usable ``--embedding-template``: raises ``ValueError`` otherwise."""
    if PLACEHOLDER not in template:
        raise ValueError(f"the embedding template must contain {PLACEHOLDER}: {template!r}")
    return template


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere


def _own_user_and_root() -> tuple[int, ...]:
    return tuple(sorted({os.getuid(), 0}))


@dataclass(frozen=True)
class ProxySettings:
    """Everything the proxy needs to know, built once by the caller (CLI, ``serve``, tests)."""

    upstream_url: str = option(
        "",
        "--upstream",
        "vLLM's base URL, e.g. http://127.0.0.1:8001",
        metavar="URL",
        shown_default="required",
    )
    upstream_uds: str | None = option(
        None,
        "--upstream-uds",
        "reach vLLM over this Unix domain socket (vLLM's --uds) instead of TCP; --upstream still "
        "names the URL (its host is ignored)",
        metavar="PATH",
        shown_default="none (TCP)",
    )
    upstream_client: str = option(
        "http1",
        "--upstream-client",
        "the HTTP client under the proxy's httpx interface to vLLM: the proxy's own HTTP/1.1 "
        "pool (the cheapest per request), aiohttp's or httpx's own",
        choices=ENGINES,
    )
    # None (the default) becomes ALL_INTERFACES with an API key, LOOPBACK without one
    # (__post_init__): vLLM's habit where it is safe.
    host: str = option(
        None,
        "--host",
        "address the proxy binds; one beyond loopback needs an API key or "
        "--allow-unauthenticated (serve refuses to start without either; proxy warns)",
        shown_default=f"{ALL_INTERFACES} (all interfaces) with an API key, else {LOOPBACK}",
    )
    port: int = option(8000, "--port", "port the proxy listens on", parse=int)
    ring_dir: str = option(
        DEFAULT_RING_DIR,
        "--ring-dir",
        "shared-memory ring directory, the same as vLLM's",
        metavar="DIR",
        env=RING_DIR_ENV,
    )
    ring_owner_uids: tuple[int, ...] = option(
        (),
        "--ring-owner-uid",
        "trust ring files owned by this user (repeatable); ring files of other users are refused",
        metavar="UID",
        parse=int,
        repeat=True,
        shown_default="the proxy's own user and root",
    )
    vector_timeout: float = option(
        5.0,
        "--vector-timeout",
        "how long a flagged request waits for its vector once vLLM has answered; then 504",
        metavar="SECONDS",
        parse=float,
    )
    max_body_bytes: int = _size_option(
        32 * MIB,
        "--max-body-size",
        "largest request body accepted; larger bodies get 413",
    )
    # -- the front server's limits (issue #25): per proxy process, so per worker -------------
    max_head_bytes: int = _size_option(
        64 * KIB,
        "--max-head-size",
        "largest request head (request line and headers); a larger one gets 431 and its "
        "connection is closed",
    )
    head_timeout: float = option(
        10.0,
        "--head-timeout",
        "a request head must be complete this long after the connection opens (or after its "
        "first byte, on a kept-alive connection); otherwise 408 and the connection is closed",
        metavar="SECONDS",
        parse=float,
    )
    body_timeout: float = option(
        60.0,
        "--body-timeout",
        "a request body must be complete this long after its head (all of it, not per chunk); "
        "otherwise 408 and the connection is closed",
        metavar="SECONDS",
        parse=float,
    )
    max_client_connections: int = option(
        1024,
        "--max-client-connections",
        "a request that arrives while this many client connections are open, or requests in "
        "progress, gets 503",
        metavar="N",
        parse=int,
    )
    body_budget_bytes: int = _size_option(
        256 * MIB,
        "--body-budget",
        "request-body bytes buffered at once over all requests; a request that would go over "
        "gets 503",
    )
    embedding_template: str = option(
        DEFAULT_TEMPLATE,
        "--embedding-template",
        "/v1/embeddings: prompt template for text inputs, with a {text} placeholder",
        metavar="TEMPLATE",
        env=EMBEDDING_TEMPLATE_ENV,
    )
    embedding_layer: int = option(
        -1,
        "--embedding-layer",
        "/v1/embeddings: the layer a request without 'layer' gets (one the server captures)",
        metavar="LAYER",
        parse=int,
    )
    embedding_pooling: str = option(
        "last",
        "--embedding-pooling",
        "/v1/embeddings: the pooling a request without 'pooling' gets",
        choices=PROMPT_POOLINGS,
    )
    max_embedding_inputs: int = option(
        2048,
        "--max-embedding-inputs",
        "/v1/embeddings: most inputs per request; more get 400",
        metavar="N",
        parse=int,
    )
    max_prompts: int = option(
        2048,
        "--max-prompts",
        "flagged /v1/completions: most prompts in a list (and conversations in a "
        "/v1/chat/completions/batch); more get 400",
        metavar="N",
        parse=int,
    )
    max_answer_bytes: int = _size_option(
        64 * MIB,
        "--max-answer-size",
        "most bytes of vLLM's answer to a flagged request the proxy holds in memory (a JSON "
        "answer, or a stream up to its first choice); more is a 502",
    )
    max_vectors_bytes: int = _size_option(
        256 * MIB,
        "--max-vectors-size",
        "most bytes of vectors and matrices one flagged request may hold in the proxy (records "
        "copied out of the rings, and their encoded answer while it is sent); more is a 413, "
        "before sending to vLLM where the size is known then",
    )
    vectors_budget_bytes: int = _size_option(
        768 * MIB,
        "--vectors-budget",
        "bytes of vectors and matrices held at once over all requests (as --max-vectors-size "
        "counts them); a request that would go over gets 503",
    )
    send_timeout: float = option(
        30.0,
        "--send-timeout",
        "a client must take each piece (1 MiB) of an answer that carries vectors within this "
        "long, and all of it within this plus its size at 1 MiB/s; otherwise its connection is "
        "cut and its memory freed",
        metavar="SECONDS",
        parse=float,
    )
    fan_out_limit: int = option(
        64,
        "--fan-out-limit",
        "most vLLM requests one client request keeps in flight (embeddings inputs, a flagged "
        "list of completions prompts)",
        metavar="N",
        parse=int,
    )
    api_key: str | None = option(
        None,
        "--api-key",
        "clients must send 'Authorization: Bearer KEY' (401 otherwise; /health stays open); "
        "prefer the variable: arguments show in process listings",
        metavar="KEY",
        env=API_KEY_ENV,
        fallback_env=(VLLM_API_KEY_ENV,),
        secret=True,
        shown_default="none",
    )
    protect_metrics: bool = option(
        False, "--protect-metrics", "with an API key, /metrics needs it too", parse=bool
    )
    allow_unauthenticated: bool = option(
        False,
        "--allow-unauthenticated",
        "listen beyond loopback (--host) without an API key: anyone who reaches the port may "
        "use the model",
        parse=bool,
    )
    upstream_api_key: str | None = option(
        None,
        "--upstream-api-key",
        "vLLM's own --api-key, when it differs from the proxy's: sent to vLLM instead of the "
        "client's Authorization header",
        metavar="KEY",
        env=UPSTREAM_API_KEY_ENV,
        secret=True,
        shown_default="none",
    )
    workers: int = option(
        1,
        "--workers",
        "proxy processes sharing the port (each reads every ring; /metrics sums them all)",
        metavar="N",
        parse=int,
    )
    log_level: str = option("info", "--log-level", "proxy log level", choices=LOG_LEVELS)
    drain_timeout: float = option(
        25.0,
        "--drain-timeout",
        "on SIGTERM or Ctrl-C, stop accepting and let requests in flight finish for this long, "
        "then cut them (within Kubernetes' default 30 s grace period, less a preStop pause)",
        metavar="SECONDS",
        parse=float,
        env=DRAIN_TIMEOUT_ENV,
    )
    metrics_upstream_timeout: float = option(
        2.0,
        "--metrics-upstream-timeout",
        "how long GET /metrics waits for vLLM's own /metrics; after it, only the proxy's series "
        "are returned and hidden_state_proxy_upstream_metrics_up is 0",
        metavar="SECONDS",
        parse=float,
        env=METRICS_UPSTREAM_TIMEOUT_ENV,
    )
    # -- not on the command line ---------------------------------------------------------------
    #: Size of the pooled connection set towards vLLM.
    max_connections: int = 1000
    #: Seconds to establish a TCP connection to vLLM.
    connect_timeout: float = 5.0
    #: Read/write timeout towards vLLM in seconds; ``None`` waits forever (long generations).
    request_timeout: float | None = None
    #: Seconds ``GET /health`` waits for vLLM's own ``/health``.
    health_timeout: float = 2.0

    def __post_init__(self) -> None:
        if not self.host:
            object.__setattr__(self, "host", ALL_INTERFACES if self.api_key else LOOPBACK)
        if not self.ring_owner_uids:
            object.__setattr__(self, "ring_owner_uids", _own_user_and_root())
        if not self.upstream_url.startswith(("http://", "https://")):
            raise ValueError(
                f"upstream_url must start with http:// or https://: {self.upstream_url!r}"
            )
        if self.vector_timeout < 0:
            raise ValueError("vector_timeout must be >= 0")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")
        for name in (
            "max_head_bytes",
            "head_timeout",
            "body_timeout",
            "max_client_connections",
            "body_budget_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        check_template(self.embedding_template)
        if self.embedding_pooling not in PROMPT_POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {', '.join(PROMPT_POOLINGS)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None disables it)")
        for name in (
            "max_embedding_inputs",
            "max_prompts",
            "max_answer_bytes",
            "max_vectors_bytes",
            "vectors_budget_bytes",
            "send_timeout",
            "fan_out_limit",
            "max_connections",
            "workers",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("connect_timeout", "health_timeout", "metrics_upstream_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0 or None")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProxySettings:
        values = json.loads(text)
        values["ring_owner_uids"] = tuple(values["ring_owner_uids"])
        return cls(**values)

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
    def exposure_problem(self) -> str | None:
        """Why listening on ``host`` is unsafe: beyond loopback with no API key (unless
        ``allow_unauthenticated``); None if it is not."""
        if self.api_key or self.allow_unauthenticated or is_loopback(self.host):
            return None
        return (
            f"--host {self.host} listens beyond this machine, but the proxy has no API key: "
            f"anyone who reaches port {self.port} could use the model. Set one with "
            f"{API_KEY_ENV} or {VLLM_API_KEY_ENV} (or --api-key), listen on --host {LOOPBACK} "
            "only, or pass --allow-unauthenticated"
        )

    @property
    def upstream_base(self) -> str:
        """``upstream_url`` without a trailing slash, ready for ``base + path``."""
        return self.upstream_url.rstrip("/")


# ---------------------------------------------------------------------------------------------
# The table, turned into a CLI, a child command line and docs
# ---------------------------------------------------------------------------------------------


def options() -> Iterator[tuple[str, Option[Any]]]:
    """(field name, option) for each settings field a user can set."""
    return option_table.options(ProxySettings)


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    skip: Sequence[str] = (),
    required: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> None:
    """One ``argparse`` option per settings field that has a flag (minus ``skip``)."""
    option_table.add_arguments(parser, ProxySettings, skip=skip, required=required, environ=environ)


def from_arguments(args: argparse.Namespace, **overrides: Any) -> ProxySettings:
    """Settings from parsed arguments (fields ``add_arguments`` skipped keep their defaults)."""
    values: dict[str, Any] = {}
    for name, _ in options():
        if hasattr(args, name):
            value = getattr(args, name)
            values[name] = tuple(value) if isinstance(value, list) else value
    values.update(overrides)
    if values.get("ring_owner_uids") is None:
        values.pop("ring_owner_uids", None)
    return ProxySettings(**values)


def command_line(settings: ProxySettings) -> list[str]:
    """``hidden-state-proxy proxy`` arguments that reproduce ``settings`` (secrets excluded).

    Values are attached with ``=``, so that one starting with ``-`` (a template, a path) is not
    taken for an option.
    """
    argv: list[str] = []
    for name, spec in options():
        value = getattr(settings, name)
        if spec.flag is None or spec.secret or value is None:
            continue
        if spec.parse is bool:
            argv += [spec.flag] if value else []
        elif spec.repeat:
            argv += [f"{spec.flag}={item}" for item in value]
        else:
            argv.append(f"{spec.flag}={value}")
    return argv


def secret_environment(settings: ProxySettings) -> dict[str, str]:
    """The secrets of ``settings``, as the environment variables the proxy reads them from."""
    secrets: dict[str, str] = {}
    for name, spec in options():
        value = getattr(settings, name)
        if spec.secret and spec.env and value:
            secrets[spec.env] = str(value)
    return secrets


def options_table() -> str:
    """The Markdown table of the proxy's options (``docs/api.md`` carries it verbatim)."""
    return option_table.markdown_table(spec for _, spec in options())
