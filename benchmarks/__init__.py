"""Developer checks of the proxy's parts, beside ``hidden-state-proxy bench`` (which measures
what a user runs): ``make bench-micro`` (``python -m benchmarks``) runs them and writes
``micro.md``, ``micro.json`` and their figures into ``bench-results/``. See docs/benchmark.md.

- :mod:`.ring_micro`: the rings' publish and lookup, in µs, with 1 and 8 rings (no server);
- :mod:`.instant` (the hop alone, in front of :mod:`.instant_upstream`, a bare uvicorn app;
  :mod:`.servers` starts them): the proxy's CPU per request against that app's, the default
  beside a Unix socket and two workers (no vLLM);
- :mod:`.matrices`: one proxy serving 64 MiB matrices, and matrix size against cost (no vLLM);
- :mod:`.layers_cost`: what ``--hidden-state-layers`` costs all traffic (four vLLM servers,
  one after the other);
- :mod:`.beside`: ordinary chats beside one client's flagged chats of each kind (one vLLM);
- :mod:`.report`: their targets and figures.

They use the package's bench harness (``vllm_hidden_state_proxy.bench``): its servers, turns,
tables and figures. Their tests are in ``tests/benchmarks``.
"""
