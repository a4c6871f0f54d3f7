"""The HTTP proxy in front of vLLM's OpenAI server. One flagged chat request, stop by stop::

client
  │  POST /v1/chat/completions  {"kv_transfer_params": {"return_last_hidden_state": true}}
  ▼
server.py            uvicorn runs the app, http_protocol.py bounding request heads in size
                     and arrival time
app.py               the route by method and path (auth.py before it: the API key, if the
  │                  proxy has one)
endpoints/__init__.py  ChatApp (the other routes' apps: endpoints/): read the body (asgi.py:
  │                  its size, its time, the process's budget of buffered bodies; the
  │                  request's share of vectors/memory.py)
inspection.py        Ordinary | Flagged: the flag's fields checked (request_fields.py), the
  │                  fields it is planned with read as vLLM reads them (planned_fields.py)
  ├─ Ordinary ─────▶ streams/relay.py: passed through byte for byte
  ▼
vectors/plan.py      the layers wanted (wanted_vectors.py), in the live rings (ring/);
  │                  refused here if they cannot serve them
keyed_exchange.py    a keyed request (keyed_request.py: a fresh request key, protocol.py, in
  │                  vllm_xargs), sent by upstream.py (headers.py) over the transport beside
  │                  proxy/ (transport/http1.py: its own HTTP/1.1 pool under httpx's API)
  ├─ JSON ─────────▶ vectors/lookup.py: the record from the rings, once vLLM has replied ──▶
  │                  vectors/fields.py (vectors/encoding.py) joined in, sent by replies.py
  └─ stream ───────▶ streams/prompt_vectors.py: held (streams/rewriting.py) up to the first
                     choice chunk (streams/events.py), the record (vectors/lookup.py) joined
                     in there (vectors/fields.py), the rest relayed (streams/relay.py)

The walk enters six rooms of the package (proxy/, request_fields.py, protocol.py,
wanted_vectors.py, ring/ and transport/), plus worker_hook/ inside vLLM, which publishes the
record; a test traces it (``tests/proxy/test_walk.py``). Other paths of a flagged request: a
completions prompt list is one keyed request whose prompts the hook tells apart by the engine
ids vLLM gives them (prompt_list.py; endpoints/completions.py; a chat batch's conversations
alike: endpoints/chat_batch.py), or, with the poolings of every prompt position, fans out like
embeddings inputs (fan_out.py; endpoints/embeddings.py), the
answer's vectors are found per choice (vectors/answers.py; in a
stream: streams/answer_vectors.py), the Responses API's stream gets them on ``response.completed``
(streams/responses.py). Every error the proxy answers itself is built in errors.py; the options are
settings.py's table; state.py and metrics.py hold per-app state; types.py the shared type aliases.

Words (one per concept, in code, docs and messages; the project's, *reply* and *answer* first
among them, are in ``protocol.py``):

- **flagged request**: a client's request whose ``kv_transfer_params`` carries
  ``return_last_hidden_state: true`` (the **flag**), asking for vectors. Any other request is
  **ordinary**. Inspection tells the two apart (``inspection.py``: ``Ordinary | Flagged``).
- **vector request** (``VectorRequest``, ``request_fields.py``): what a flagged request asks
  for, as the client wrote it; **wanted vectors** (``WantedVectors``, ``wanted_vectors.py``): the
  same in absolute layers of the live rings.
- **keyed request**: a request the proxy sends vLLM for a flagged request, with a fresh
  request key in ``vllm_xargs`` (``keyed_request.py``). A flagged request is sent as one keyed
  request (a list of prompts too: ``prompt_list.py``, each prompt's records under a key derived
  from the list's), or as several (embeddings inputs, a list of prompts with ``"mean"`` or
  ``"all_prompt"``: the **fan-out**, ``fan_out.py``).
- **exchange**: everything that answers one client request once its body is read, from the
  request to vLLM to the client's last byte; an endpoint builds it (``endpoints/``), a client
  that leaves cancels it.
- **pass through**: send a request to vLLM as the client sent it and relay the reply back
  untouched (ordinary requests, every other path).
- **relay**: copy vLLM's reply to the client as it arrives (``streams/relay.py``).
- **join**: put the vectors into vLLM's reply (``vectors/fields.py``, sent by ``replies.py``;
  for streams ``streams/``).
- **response**: what the proxy sends the client (vLLM's reply, unchanged or joined, or the
  proxy's own error).
"""

from vllm_hidden_state_proxy.proxy.app import create_app
from vllm_hidden_state_proxy.proxy.server import serve_proxy
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

__all__ = ["ProxySettings", "create_app", "serve_proxy"]
