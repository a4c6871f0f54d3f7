"""The object stores the tests run extract on (moto's S3, tests/moto_s3.py; gcp-storage-emulator's
GCS, tests/gcs_emulator.py), and the environment that points a client at one as a user's would:
variables only, read by the store's library and by fsspec (``FSSPEC_<PROTOCOL>_<ARG>``)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any, Protocol


class Store(Protocol):
    """A store's server on 127.0.0.1: its endpoint, its environment, buckets and a client."""

    @property
    def endpoint(self) -> str: ...

    @property
    def env(self) -> dict[str, str]: ...

    @property
    def protocol(self) -> str:
        """fsspec's protocol, the scheme of the store's URIs (``s3``, ``gs``)."""
        ...

    def bucket(self) -> str:
        """A new bucket's name (made)."""
        ...

    def fs(self) -> Any:
        """A client of the store's own, outside extract (made from the endpoint, not the
        environment)."""
        ...


@contextlib.contextmanager
def store_environment(store: Store) -> Iterator[None]:
    """The environment pointed at ``store`` (and back). fsspec reads its ``FSSPEC_*`` variables
    when imported, so they are read again here; its instances of the store's filesystem are
    forgotten on both sides (it keeps one per set of arguments, which the environment is not
    part of)."""
    import fsspec
    import fsspec.config

    before = {name: os.environ.get(name) for name in store.env}
    configuration = copy.deepcopy(fsspec.config.conf)
    os.environ.update(store.env)
    fsspec.config.set_conf_env(fsspec.config.conf)
    fsspec.get_filesystem_class(store.protocol).clear_instance_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        fsspec.config.conf.clear()
        fsspec.config.conf.update(configuration)
        fsspec.get_filesystem_class(store.protocol).clear_instance_cache()
