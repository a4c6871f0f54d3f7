"""``hidden-state-proxy extract``: a corpus in (JSONL or Parquet), a dataset of hidden states
out (Parquet parts, a manifest, an errors file), through one or more proxies (docs/extract.md).

Along the data's path:

- ``options.py``: the options table;
- ``inputs.py``: reading the corpus, streamed, each input checked (what no JSON request can
  carry included) and its id once, each line bounded;
- ``proxies.py``: the proxies' capture descriptions and how many requests each may have in
  flight (its rings' slots, its front server's connections);
- ``limits.py``: the bounds on one input's request body and answer;
- ``exchange.py``: one request, its body encoded once, its answer read within ``--timeout``
  and ``--max-answer-size`` (decoded);
- ``rows.py``: an answer's rows, checked whole: what cannot make them fails that input alone;
- ``output_dir.py``: which files of ``--output`` are extract's, and what a run may do there;
- ``resume.py``: what ``--resume`` checks (the manifest's and each part's settings, the
  parts' columns);
- ``dataset.py``: the Parquet parts, written as answers arrive, and the manifest;
- ``runner.py``: the run (bounded concurrency, retries, Ctrl-C, a stop) and the summary;
- ``progress.py``: the run's counts (retries by cause) and its progress line.

pyarrow is the ``extract`` extra's: it is imported only when a run starts.

Beyond one machine (issue #48):

- ``storage.py``: INPUT and ``--output`` on an object store (``s3://``: fsspec, the
  ``object-store`` extra) or a local path;
- ``mapper.py``: the same requests and rows as a batch mapper, for Ray Data's ``map_batches``
  and ``datasets``' ``map``.
"""
