"""``hidden-state-proxy bench``: what the proxy costs, side by side with vLLM alone
(docs/benchmark.md). :mod:`.main` runs the phases ``--phases`` names (:mod:`.options`: the
option table), one module each with a ``run()``, on their harness: :mod:`.turns` (arms taking
turns), :mod:`.client`, :mod:`.servers`, :mod:`.usage`, :mod:`.stats`, :mod:`.progress`,
:mod:`.report` and :mod:`.figures`, which the developer checks (``benchmarks/``) use too.
"""
