"""``hidden-state-proxy bench``: what the proxy costs, measured against vLLM on its own and
against a bare uvicorn app. See docs/benchmark.md.

- :mod:`.main`: the order of a run; :mod:`.options`: its command line.
- The phases: :mod:`.ring_micro`, :mod:`.instant` (the hop alone, in front of
  :mod:`.instant_upstream`), :mod:`.latency` (and CPU per request),
  :mod:`.streaming`, :mod:`.throughput`, :mod:`.embeddings`, :mod:`.layers_cost`.
- Their tools: :mod:`.turns` (the loop they share: arms taking turns, bursts, tallies),
  :mod:`.client` (request bodies, timed HTTP calls), :mod:`.stats`, :mod:`.usage` (CPU and
  memory, psutil), :mod:`.servers` (what the bench starts), :mod:`.progress`, :mod:`.report`
  (tables, targets, markdown and JSON).
"""
