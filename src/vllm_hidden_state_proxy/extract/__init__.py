"""``hidden-state-proxy extract``: a corpus in (JSONL or Parquet), a dataset of hidden states
out (Parquet parts, a manifest, an errors file), through one or more proxies (docs/extract.md).

- ``options.py``: the options table;
- ``inputs.py``: reading the corpus, streamed, each input checked and its id once;
- ``proxies.py``: the proxies' capture descriptions and how many requests each may have in
  flight;
- ``runner.py``: the requests (bounded concurrency, retries, Ctrl-C, a stop) and the summary;
- ``progress.py``: the run's counts and its progress line;
- ``dataset.py``: the Parquet parts, written as answers arrive, and the manifest.

pyarrow is the ``extract`` extra's: it is imported only when a run starts.
"""
