"""A Google Cloud Storage for the tests: gcp-storage-emulator (a stub of GCS's JSON API) on a free
port of 127.0.0.1, in a thread of the test process, its objects in memory (nothing written to
disk), reached over HTTP by gcsfs as GCS would be. Its environment is what a user points gcsfs at
an emulator with (tests/object_stores.py sets it): ``STORAGE_EMULATOR_HOST``; fsspec's
``FSSPEC_GS_TOKEN=anon`` (no credentials, and none looked for: without it gcsfs tries Application
Default Credentials, which ask the cloud's metadata server); and
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs (2026.10) otherwise asks GCS's Storage Control
API over gRPC for each bucket's layout, which the emulator does not serve (each call waits out
its 60 s of retries). Nothing on the command line."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tests.object_stores import Store

#: gcsfs reads it once, when imported: the class it names GCSFileSystem depends on it.
_PLAIN_GCSFS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


class GCS(Store):
    """The emulator: its endpoint and the environment that points a client at it."""

    protocol = "gs"

    def fs(self) -> Any:
        from gcsfs.core import GCSFileSystem  # the plain class, whatever the import chose

        return GCSFileSystem(endpoint_url=self.endpoint, token="anon", skip_instance_cache=True)


@contextlib.contextmanager
def gcs_emulator() -> Iterator[GCS]:
    from gcp_storage_emulator.server import create_server

    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError(
            f"gcsfs was imported before {_PLAIN_GCSFS}=false was set: its GCSFileSystem asks the "
            "emulator for gRPC, which it does not serve"
        )
    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)  # a line per request
    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    # The emulator binds the port it is given (0: a free one) and keeps which to its HTTP server.
    httpd = server._api._httpd
    host, port = httpd.server_address[:2]
    httpd.handle_error = _quiet_when_hung_up(httpd.handle_error)
    endpoint = f"http://{host}:{port}"
    env = {"STORAGE_EMULATOR_HOST": endpoint, "FSSPEC_GS_TOKEN": "anon", _PLAIN_GCSFS: "false"}
    try:
        yield GCS(endpoint, env)
    finally:
        server.stop()


def _quiet_when_hung_up(handle_error: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """The server's error report, less a client that hung up: gcsfs asks for an object and for a
    prefix of its name at once and drops the second once the first answers, as it does with GCS
    (a traceback on stderr each time otherwise)."""

    def report(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            handle_error(request, client_address)

    return report
