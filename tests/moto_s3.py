"""An S3 for the tests: moto's server mode on a free port of 127.0.0.1, in a thread of the test
process, reached over HTTP as any S3 (by s3fs here, by Ray's workers in the e2e test), its
endpoint and made-up keys in the environment as a user's would be (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``...; tests/object_stores.py sets them): nothing on the command line."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from tests.object_stores import Store


class S3(Store):
    """moto's S3 server: its endpoint and the environment that points a client at it."""

    protocol = "s3"

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=self.endpoint,
            key=self.env["AWS_ACCESS_KEY_ID"],
            secret=self.env["AWS_SECRET_ACCESS_KEY"],
            skip_instance_cache=True,
        )


@contextlib.contextmanager
def moto_s3() -> Iterator[S3]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        yield S3(endpoint, env)
    finally:
        server.stop()
