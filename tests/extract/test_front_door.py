"""``extract`` with its defaults against the real proxy at its defaults' proportions (uvicorn's
connection bound, ``--max-client-connections``, equal to the ring's slots), over real sockets and
extract's own transport (the default engine): its default in flight stays below what the proxy's
front server accepts, so no request is refused at the front door (issue #50: the default in flight
once equalled both, and 6,000 inputs took 589 retries on the front server's 503s). The proxy's vLLM
is the fake of ``tests/proxy/raw_http.py``, which publishes into a real ring; each of its requests
takes 10 ms, as a step of vLLM's would (without it, the proxy's finished tasks, which uvicorn counts
until they end, are about as many as its requests in flight: the margin is theirs,
``extract/proxies.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.extract.runs import corpus, manifest, options, run, table, write_jsonl
from tests.proxy.fakes import settings_for
from tests.proxy.raw_http import serving

#: The ring of ``serving`` has 64 slots: the proxy takes as many connections.
CONNECTIONS = 64


def test_the_default_in_flight_takes_no_front_door_503s(tmp_path: Path) -> None:
    settings = settings_for(
        str(tmp_path / "rings"),
        port=0,
        log_level="warning",
        max_client_connections=CONNECTIONS,
    )
    (tmp_path / "rings").mkdir()
    inputs = write_jsonl(tmp_path / "in.jsonl", corpus(600))
    out = tmp_path / "out"
    with serving(settings, upstream_latency=0.01) as served:
        url = f"http://127.0.0.1:{served.port}"
        status, stderr = run(inputs, options(out, urls=(url,)), None)
    assert status == 0, stderr
    assert len(table(out)) == 600
    last = manifest(out)["runs"][-1]
    assert last["concurrency"] < CONNECTIONS
    assert last["retries"] == 0, last["retries_by_cause"]
