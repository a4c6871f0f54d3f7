"""The type aliases the proxy's modules share, and nothing else: each name has one home.

ASGI's (``Scope``, ``Receive``, ``Send``, ``Message``, ``ASGIApp``) are Starlette's
(``starlette.types``); the client's field names are ``protocol.py``'s; what a flagged request
asks for is ``request_fields.py``'s (``VectorRequest``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

#: HTTP headers as ASGI and httpx carry them: (name, value) byte pairs, in order.
RawHeaders = list[tuple[bytes, bytes]]
#: The vectors' fields of a flagged request, looked up when its stream reaches the event they
#: ride on (a stream rewriter is handed this, not the record).
FieldsLater = Callable[[], Awaitable[dict[str, Any]]]
