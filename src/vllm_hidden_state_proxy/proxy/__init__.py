"""The HTTP proxy in front of vLLM's OpenAI server. One flagged request, stop by stop::

client
  │  POST /v1/chat/completions  {"kv_transfer_params": {"return_last_hidden_state": true}}
  ▼
server.py            uvicorn runs the app that app.py assembles (routes, lifespan), with
                     http_protocol.py: request heads bounded in size and arrival time
auth.py              the API key, if the proxy has one
chat_app.py          the endpoint (completions_app.py, embeddings_app.py, passthrough_app.py,
  │                  ops_app.py, capture_app.py: what the server captures; the others)
  ▼
endpoints.py         the POST endpoints' base classes: read the body (asgi.py: its size, its
  │                  time, the process's budget of buffered bodies), build the exchange or
  │                  refuse; chat, completions, responses: inspect (inspection.py:
  │                  Ordinary | Flagged), resolve the layers against the live rings
  │                  (vector_lookup.py)
  ├─ Ordinary ─────▶ relay.py: pass through byte for byte (upstream.py, headers.py)
  ▼
keyed_exchange.py    a fresh request key into vllm_xargs; send to vLLM (upstream.py, over
  │                  transport/aiohttp_client.py: aiohttp's client under httpx's interface)
  ├─ JSON ─────────▶ vector_lookup.py: the record from the rings (a large matrix copied in
  │                  a thread, counted by vector_memory.py) ──▶ answer_join.py, sent by
  │                  answer_body.py (large matrices in pieces; sends of vectors within a deadline)
  └─ stream ───────▶ stream_rewrite.py: hold to the first choice chunk, join the vectors
                     there (vector_lookup.py, answer_join.py), relay the rest (relay.py);
                     /v1/responses: responses_stream.py
fan_out.py           several keyed requests for one client request (prompt lists,
                     embeddings inputs; embeddings_plan.py turns the inputs into them)
errors.py            every error the proxy answers itself, and the factories naming the fix
types.py             the shared type aliases; settings.py: the options table; state.py,
                     metrics.py: per-app state

Words (one per concept, in code, docs and messages; the project's, *reply* and *answer* first
among them, are in ``protocol.py``):

- **flagged request**: a client's request whose ``kv_transfer_params`` carries
  ``return_last_hidden_state: true`` (the **flag**), asking for vectors. Any other request is
  **ordinary**. Inspection tells the two apart (``inspection.py``: ``Ordinary | Flagged``).
- **vector request** (``VectorRequest``, ``request_fields.py``): what a flagged request asks
  for, as the client wrote it; **wanted vectors** (``WantedVectors``): the same in absolute
  layers of the live rings.
- **keyed request**: a request the proxy sends vLLM for a flagged request, with a fresh
  request key in ``vllm_xargs``. A flagged request is sent as one keyed request, or as several
  (a list of prompts, embeddings inputs: the **fan-out**, ``fan_out.py``).
- **exchange**: everything that answers one client request once its body is read, from the
  request to vLLM to the client's last byte; an endpoint builds it (``endpoints.py``), a client
  that leaves cancels it.
- **pass through**: send a request to vLLM as the client sent it and relay the reply back
  untouched (ordinary requests, every other path).
- **relay**: copy vLLM's reply to the client as it arrives.
- **join**: put the vectors into vLLM's reply (``answer_join.py``, and for streams
  ``stream_rewrite.py``, ``responses_stream.py``).
"""

from vllm_hidden_state_proxy.proxy.app import create_app
from vllm_hidden_state_proxy.proxy.server import serve_proxy
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

__all__ = ["ProxySettings", "create_app", "serve_proxy"]
