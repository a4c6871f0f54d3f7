"""``GET /v1/hidden_states``: what this server captures, and what one request may ask for.

Read from the live rings' headers (each engine's hidden size, layers, arena and largest
record), the proxy's own limits and vLLM's ``/v1/models``. Clients read it
(``client.read_capture``) instead of learning the layers from a 400's text; ``check`` too.

.. code-block:: json

    {"object": "hidden_state_capture", "model": "Qwen/Qwen3-0.6B", "models": [...],
     "hidden_size": 1024, "num_hidden_layers": 28, "layers": [8, 28],
     "poolings": [...], "formats": ["float", "base64"], "dtypes": [...],
     "limits": {"max_prompts": 2048, "max_spans": 1024, "max_layers": 1024,
                "max_record_bytes": 67108864, "arena_bytes": 268435456,
                "max_embedding_inputs": 2048, "max_body_bytes": 33554432,
                "max_client_connections": 1024},
     "engines": [{"instance": "3f2a9c0d1e5b7a64", "engine": 0, "runner": "vLLM 0.32.0 ...",
                  "hidden_size": 1024, "num_hidden_layers": 28, "layers": [8, 28],
                  "slots": 1024, "arena_bytes": 268435456, "max_record_bytes": 67108864}]}

``layers`` are the absolute indices every engine captures (a request may name them, or count
from the end: ``num_hidden_layers`` is ``-1``); ``limits`` hold the smallest engine's arena and
record size (a request may land on any engine), and ``max_client_connections`` the connections
this process's front server takes (``--max-client-connections``: what ``extract`` keeps its
requests in flight below). No live ring: the 503 a flagged request gets.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from vllm_hidden_state_proxy.protocol import (
    DTYPES,
    FORMATS,
    MATRIX_POOLINGS,
    MAX_LAYERS,
    MAX_SPANS,
    REQUESTED_POOLINGS,
)
from vllm_hidden_state_proxy.proxy.asgi import header_value, send_error, send_response
from vllm_hidden_state_proxy.proxy.errors import ProxyError, models_unreadable
from vllm_hidden_state_proxy.proxy.state import ProxyState
from vllm_hidden_state_proxy.proxy.vectors.encoding import dump_json
from vllm_hidden_state_proxy.proxy.vectors.plan import check_rings
from vllm_hidden_state_proxy.ring import RingHeader
from vllm_hidden_state_proxy.transport.ops import MODELS_PATH


def _engine(header: RingHeader) -> dict[str, Any]:
    shape = header.shape
    return {
        "instance": f"{header.instance:016x}",
        "engine": header.engine,
        "runner": header.runner,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "layers": list(shape.layers),
        "slots": shape.slot_count,
        "arena_bytes": shape.arena_size,
        "max_record_bytes": shape.max_record,
    }


class CaptureApp:
    """The capture description (see the module docstring)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        try:
            shapes = check_rings(state.rings, state.settings.ring_dir)
            models = await self._models(scope)
        except ProxyError as error:
            await send_error(send, error)
            return
        headers = state.rings.live_headers()
        captured = set(shapes[0].layers)
        for shape in shapes[1:]:
            captured &= set(shape.layers)
        arena = min(shape.arena_size for shape in shapes)
        settings = state.settings
        document = {
            "object": "hidden_state_capture",
            "model": models[0] if models else None,
            "models": models,
            "hidden_size": shapes[0].hidden_size,
            "num_hidden_layers": shapes[0].num_hidden_layers,
            "layers": sorted(captured),
            "poolings": [p for p in REQUESTED_POOLINGS if arena or p not in MATRIX_POOLINGS],
            "formats": list(FORMATS),
            "dtypes": list(DTYPES),
            "limits": {
                "max_prompts": settings.max_prompts,
                "max_spans": MAX_SPANS,
                "max_layers": MAX_LAYERS,
                "max_record_bytes": min(shape.max_record for shape in shapes),
                "arena_bytes": arena,
                "max_embedding_inputs": settings.max_embedding_inputs,
                "max_body_bytes": settings.max_body_bytes,
                "max_client_connections": settings.max_client_connections,
            },
            "engines": [_engine(header) for header in headers],
        }
        await send_response(send, 200, dump_json(document), b"application/json")

    async def _models(self, scope: Scope) -> list[str]:
        """vLLM's served model names (``/v1/models``), with the key vLLM wants."""
        settings = self.state.settings
        authorization = None
        if settings.upstream_api_key:
            authorization = f"Bearer {settings.upstream_api_key}"
        else:
            client_authorization = header_value(scope, b"authorization")
            if client_authorization is not None:
                authorization = client_authorization.decode("latin-1")
        try:
            reply = await self.state.ops_client.get(
                MODELS_PATH, settings.health_timeout, "application/json", authorization
            )
        except (TimeoutError, httpx.HTTPError) as exc:
            raise models_unreadable(exc) from None
        if reply.status != 200:
            raise models_unreadable(status=reply.status)
        try:
            data = orjson.loads(reply.content)["data"]
            return [str(model["id"]) for model in data]
        except (ValueError, KeyError, TypeError):
            raise models_unreadable() from None
