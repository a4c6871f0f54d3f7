"""The client side: ask for hidden states and read them back as numpy arrays (numpy alone).

Nothing here imports the proxy, the rings or vLLM: a client-only install is the package without
its dependencies plus numpy (``pip install --no-deps vllm-hidden-state-proxy numpy``; see
docs/clients.md). It works with any HTTP client; the OpenAI SDK is the usual one:

.. code-block:: python

    from vllm_hidden_state_proxy.client import hidden_state_fields, read_hidden_states

    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=1,
        extra_body=hidden_state_fields(layers=[0, -1], info=True),
    )
    states = read_hidden_states(response)
    states.vector                # the final layer's vector, float32, shape (hidden_size,)
    states.by_layer[0]           # layer 0's
    states.info["position"]

Words (as in ``protocol.py``): one **entry** is what the proxy returns for one prompt (one
prompt of a completions list) or, with an answer pooling (``"last_answer"``, ``"all_answer"``),
for one choice: a **vector** ``(hidden_size,)`` or a **matrix** ``(rows, hidden_size)`` per
layer, and its ``info``. :class:`HiddenStates` is one entry; :class:`HiddenStateAnswer` every
entry of one answer, in prompt (or choice) order.

- :func:`hidden_state_fields`: the request's fields, checked as the proxy checks them (a
  :class:`HiddenStateRequestError`, a ``ValueError``, before anything is sent);
- :func:`read_hidden_states`: an answer (an OpenAI SDK object, a dict, an httpx response) to
  a :class:`HiddenStateAnswer`;
- :class:`HiddenStateStream`: fed a stream's chunks (chat, completions) or events (responses)
  one by one, the same :class:`HiddenStateAnswer` at the end;
- :func:`read_capture`: the server's ``GET /v1/hidden_states`` (what it captures, its limits)
  as a :class:`Capture`.

A malformed answer (bad base64, a size that is not the shape's, a missing field) raises
:class:`HiddenStateDecodeError`, a ``ValueError`` naming the field; an error answer (an HTTP
status other than 200, an ``{"error": ...}`` body or stream event) raises
:class:`HiddenStateServerError` with the server's message and status.
"""

from vllm_hidden_state_proxy.client.answers import (
    HiddenStateAnswer,
    HiddenStates,
    HiddenStateStream,
    decode_values,
    read_hidden_states,
)
from vllm_hidden_state_proxy.client.capture import Capture, CaptureEngine, read_capture
from vllm_hidden_state_proxy.client.fields import hidden_state_fields
from vllm_hidden_state_proxy.client.types import (
    Array,
    Dtype,
    Format,
    HiddenStateDecodeError,
    HiddenStateRequestError,
    HiddenStateServerError,
    Pooling,
)
from vllm_hidden_state_proxy.protocol import CAPTURE_PATH

__all__ = [
    "CAPTURE_PATH",
    "Array",
    "Capture",
    "CaptureEngine",
    "Dtype",
    "Format",
    "HiddenStateAnswer",
    "HiddenStateDecodeError",
    "HiddenStateRequestError",
    "HiddenStateServerError",
    "HiddenStateStream",
    "HiddenStates",
    "Pooling",
    "decode_values",
    "hidden_state_fields",
    "read_capture",
    "read_hidden_states",
]
