"""``hidden-state-proxy extract``: a corpus in (JSONL or Parquet), a dataset of hidden states
out (Parquet parts, a manifest, an errors file), through one or more proxies (docs/extract.md).

Along the data's path:

- ``options.py``: the options table;
- ``inputs.py``: reading the corpus, streamed, each input checked (what no JSON request can
  carry included) and its id once, each line bounded;
- ``proxies.py``: the proxies' capture descriptions and how many inputs each may have in
  flight (its rings' slots, its front server's connections);
- ``limits.py``: the bounds on one input's request body and answer;
- ``batches.py``: inputs grouped into batches of one kind (text, token ids, chats), each
  input's prompt encoded once, a request's body joined from those bytes;
- ``sender.py``: a batch's requests (retries, the proxy with the fewest in flight), split in
  halves when it fails, so one bad input fails alone;
- ``exchange.py``: one request, its answer read within ``--timeout`` and
  ``--max-answer-size`` (decoded);
- ``rows.py``: an answer's rows (a batch's: one choice and one entry per input), checked
  whole: what cannot make them fails that input (a batch: is split);
- ``output_dir.py``: which files of ``--output`` are extract's, and what a run may do there;
- ``resume.py``: what ``--resume`` checks (the manifest's and each part's settings, the
  parts' columns);
- ``dataset.py``: the Parquet parts, written as answers arrive, and the manifest;
- ``write_behind.py``: the parts' writes on a thread of their own;
- ``runner.py``: the run (bounded concurrency, retries, Ctrl-C, a stop) and the summary;
- ``progress.py``: the run's counts (retries by cause) and its progress line.

pyarrow is the ``extract`` extra's: it is imported only when a run starts.

Beyond one machine (issue #48):

- ``storage.py``: INPUT and ``--output`` on an object store (``s3://``: fsspec, the
  ``object-store`` extra) or a local path;
- ``mapper.py``: the same requests and rows as a batch mapper, for Ray Data's ``map_batches``
  and ``datasets``' ``map``.
"""
