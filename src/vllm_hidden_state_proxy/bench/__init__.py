"""``hidden-state-proxy bench``: what the proxy costs, measured against vLLM on its own.

One module per job: :mod:`.options` (command line), :mod:`.stats` (percentiles),
:mod:`.interleave` (round-robin order), :mod:`.progress` (stderr progress), :mod:`.lock` (one
vLLM server at a time), :mod:`.procs` (resident memory from ``/proc``), :mod:`.servers` (the
chat stack, the pooling server), :mod:`.nginx` (the reverse-proxy anchor), :mod:`.client`
(timed HTTP calls), :mod:`.latency`, :mod:`.streaming`, :mod:`.throughput`, :mod:`.embeddings`,
:mod:`.ring_micro` and :mod:`.pooling` (the measurements), :mod:`.results` (what a run found),
:mod:`.targets` (ratios against the goals of issue #6), :mod:`.report` (markdown and JSON),
:mod:`.plot` (PNG) and :mod:`.main` (the order of the phases). See docs/benchmark.md.
"""
