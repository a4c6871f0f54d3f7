"""What the server captures: :func:`read_capture` of ``GET /v1/hidden_states``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.client.answers import as_document, error_message
from vllm_hidden_state_proxy.client.types import HiddenStateDecodeError, HiddenStateServerError
from vllm_hidden_state_proxy.request_fields import is_int as _is_int


@dataclass(frozen=True)
class CaptureEngine:
    """One vLLM engine's ring: what its hook captures, and its sizes."""

    instance: str
    engine: int
    runner: str
    hidden_size: int
    num_hidden_layers: int
    layers: tuple[int, ...]
    slots: int
    arena_bytes: int
    max_record_bytes: int


@dataclass(frozen=True)
class Capture:
    """``GET /v1/hidden_states``: what a request may ask of this server."""

    model: str | None
    models: tuple[str, ...]
    hidden_size: int
    num_hidden_layers: int
    #: Absolute indices every engine captures (``num_hidden_layers`` is the final layer).
    layers: tuple[int, ...]
    poolings: tuple[str, ...]
    formats: tuple[str, ...]
    dtypes: tuple[str, ...]
    #: ``max_prompts``, ``max_spans``, ``max_layers``, ``max_record_bytes``, ``arena_bytes``,
    #: ``max_embedding_inputs``, ``max_body_bytes``.
    limits: Mapping[str, int]
    engines: tuple[CaptureEngine, ...]

    def captures(self, layer: int) -> bool:
        """Whether ``layer`` (negative: from the end) is captured."""
        absolute = layer + self.num_hidden_layers + 1 if layer < 0 else layer
        return absolute in self.layers


def read_capture(answer: Any) -> Capture:
    """The capture endpoint's answer (an httpx response, a dict or JSON text) as a
    :class:`Capture`. Its 503 (no ring yet, and why) raises :class:`HiddenStateServerError`."""
    document = as_document(answer)
    message = error_message(document)
    if message is not None:
        code = document["error"].get("code")
        raise HiddenStateServerError(message, code if _is_int(code) else None)
    try:
        return Capture(
            model=document.get("model"),
            models=tuple(str(m) for m in document.get("models") or ()),
            hidden_size=int(document["hidden_size"]),
            num_hidden_layers=int(document["num_hidden_layers"]),
            layers=tuple(int(k) for k in document["layers"]),
            poolings=tuple(str(p) for p in document["poolings"]),
            formats=tuple(str(f) for f in document["formats"]),
            dtypes=tuple(str(d) for d in document["dtypes"]),
            limits={str(k): int(v) for k, v in document["limits"].items()},
            engines=tuple(
                CaptureEngine(
                    instance=str(e["instance"]),
                    engine=int(e["engine"]),
                    runner=str(e.get("runner", "")),
                    hidden_size=int(e["hidden_size"]),
                    num_hidden_layers=int(e["num_hidden_layers"]),
                    layers=tuple(int(k) for k in e["layers"]),
                    slots=int(e["slots"]),
                    arena_bytes=int(e["arena_bytes"]),
                    max_record_bytes=int(e["max_record_bytes"]),
                )
                for e in document["engines"]
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise HiddenStateDecodeError(
            f"the capture description lacks or mistypes {exc}: is the server "
            "vllm-hidden-state-proxy of this release?"
        ) from None
