"""What the server captures: :func:`read_capture` of ``GET /v1/hidden_states``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.client.answers import as_document, server_error
from vllm_hidden_state_proxy.client.types import HiddenStateDecodeError
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


#: Counts (sizes, layers, slots) are below this; byte sizes below :data:`_MAX_BYTES`.
_MAX_COUNT = 1 << 31
_MAX_BYTES = 1 << 62


def _missing(document: Mapping[str, Any], name: str, where: str) -> None:
    if name not in document:
        raise HiddenStateDecodeError(
            f"the capture description lacks '{where}{name}': is the server "
            "vllm-hidden-state-proxy of this release?"
        )


def _integer(document: Mapping[str, Any], name: str, where: str, *, least: int = 0) -> int:
    """``document[name]``: a JSON integer from ``least`` to the bound of its kind."""
    _missing(document, name, where)
    value = document[name]
    most = _MAX_BYTES if name.endswith("bytes") else _MAX_COUNT
    if not (_is_int(value) and least <= value < most):
        raise HiddenStateDecodeError(
            f"the capture description's '{where}{name}' is {value!r}, not an integer from "
            f"{least} below {most}."
        )
    return value


def _items(document: Mapping[str, Any], name: str, where: str, kind: type) -> list[Any]:
    """``document[name]``: a JSON list whose items are ``kind``."""
    _missing(document, name, where)
    value = document[name]
    if not isinstance(value, list) or not all(
        isinstance(item, kind) and (kind is not int or _is_int(item)) for item in value
    ):
        raise HiddenStateDecodeError(
            f"the capture description's '{where}{name}' is {str(value)[:80]!r}, not a list of "
            f"{kind.__name__}s."
        )
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise HiddenStateDecodeError(
            f"the capture description's '{where}' is {str(value)[:80]!r}, not an object: is the "
            "server vllm-hidden-state-proxy of this release?"
        )
    return value


def _layers(document: Mapping[str, Any], where: str) -> tuple[int, ...]:
    layers = _items(document, "layers", where, int)
    if not all(0 <= k < _MAX_COUNT for k in layers):
        raise HiddenStateDecodeError(
            f"the capture description's '{where}layers' are {layers!r}, not layer indices."
        )
    return tuple(layers)


def _engine(document: Any, where: str) -> CaptureEngine:
    engine = _object(document, where.rstrip("."))
    instance, runner = engine.get("instance"), engine.get("runner", "")
    if not isinstance(instance, str) or not isinstance(runner, str):
        raise HiddenStateDecodeError(
            f"the capture description's '{where}instance' or '{where}runner' is not a string."
        )
    return CaptureEngine(
        instance=instance,
        engine=_integer(engine, "engine", where),
        runner=runner,
        hidden_size=_integer(engine, "hidden_size", where, least=1),
        num_hidden_layers=_integer(engine, "num_hidden_layers", where),
        layers=_layers(engine, where),
        slots=_integer(engine, "slots", where, least=1),
        arena_bytes=_integer(engine, "arena_bytes", where),
        max_record_bytes=_integer(engine, "max_record_bytes", where),
    )


def read_capture(answer: Any) -> Capture:
    """The capture endpoint's answer (an httpx response, a dict or JSON text) as a
    :class:`Capture`. Its 503 (no ring yet, and why) raises :class:`HiddenStateServerError`;
    a field missing or of another type, :class:`HiddenStateDecodeError` naming it."""
    document = as_document(answer)
    error = server_error(document)
    if error is not None:
        raise error
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise HiddenStateDecodeError(f"the capture description's 'model' is {model!r}, not a name.")
    limits = _object(document.get("limits"), "limits")
    return Capture(
        model=model,
        models=tuple(_items(document, "models", "", str)) if "models" in document else (),
        hidden_size=_integer(document, "hidden_size", "", least=1),
        num_hidden_layers=_integer(document, "num_hidden_layers", ""),
        layers=_layers(document, ""),
        poolings=tuple(_items(document, "poolings", "", str)),
        formats=tuple(_items(document, "formats", "", str)),
        dtypes=tuple(_items(document, "dtypes", "", str)),
        limits={str(name): _integer(limits, name, "limits.") for name in limits},
        engines=tuple(
            _engine(engine, f"engines[{i}].")
            for i, engine in enumerate(_items(document, "engines", "", object))
        ),
    )
