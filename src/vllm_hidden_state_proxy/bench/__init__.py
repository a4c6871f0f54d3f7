"""``hidden-state-proxy bench``: what the proxy costs, measured against vLLM on its own and
against a bare uvicorn app. See docs/benchmark.md.

- :mod:`.main`: the order of a run; :mod:`.options`: its command line.
- The phases: :mod:`.ring_micro`, :mod:`.instant` (the hop alone, in front of
  :mod:`.instant_upstream`), :mod:`.latency` (and CPU per request), :mod:`.streaming`,
  :mod:`.throughput`, :mod:`.embeddings`.
- Their tools: :mod:`.client` (request bodies, timed HTTP calls), :mod:`.interleave` (the order
  in which arms take turns), :mod:`.stats`, :mod:`.usage` (CPU and memory, psutil),
  :mod:`.servers` (what the bench starts), :mod:`.progress`, :mod:`.report` (tables, targets,
  markdown and JSON).
"""
