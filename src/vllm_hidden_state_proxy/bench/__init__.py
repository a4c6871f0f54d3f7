"""``hidden-state-proxy bench``: what the proxy costs, side by side with vLLM alone. See
docs/benchmark.md.

- :mod:`.main`: the order of a run; :mod:`.options`: its option table (``--phases``).
- The phases, one module each with a ``run()``: :mod:`.latency`, :mod:`.hop` (CPU per
  request), :mod:`.streaming`, :mod:`.answers`, :mod:`.throughput`, :mod:`.embeddings`,
  :mod:`.extract_compare` (``extract`` against vLLM's pooling server).
- Their harness: :mod:`.turns` (arms taking turns, bursts, tallies), :mod:`.client` (request
  bodies, timed HTTP calls), :mod:`.stats`, :mod:`.usage` (CPU and memory, psutil),
  :mod:`.servers` (what the bench starts), :mod:`.progress`, :mod:`.report` (tables, targets,
  markdown and JSON), :mod:`.figures`. The developer checks of the parts use it too
  (``benchmarks/`` at the repository root, ``make bench-micro``).
"""
