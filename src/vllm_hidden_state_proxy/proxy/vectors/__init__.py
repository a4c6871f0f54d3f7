"""A flagged request's vectors, from the rings to the JSON text of vLLM's reply:

- :mod:`.plan`: before sending, what the rings can serve (:class:`~.plan.WantedVectors`);
- :mod:`.lookup`: once vLLM has replied, the record in the rings (waiting for it if need be);
- :mod:`.answers`: the answer's records, one per choice (poolings ``"last_answer"``,
  ``"all_answer"``), found by each choice's token count;
- :mod:`.memory`: the bytes they take in this process, bounded per request and in all;
- :mod:`.fields`: the ``kv_transfer_params`` fields the records become;
- :mod:`.encoding`: a vector or matrix as JSON text (floats, base64, 16-bit).
"""
