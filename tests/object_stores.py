"""The object stores the tests run extract on (moto's S3, tests/moto_s3.py; gcp-storage-emulator's
GCS, tests/gcs_emulator.py), and the environment that points a client at one as a user's would:
variables only, read by the store's library and by fsspec (``FSSPEC_<PROTOCOL>_<ARG>``)."""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Store:
    """A store's server on 127.0.0.1: its endpoint and the environment that points a client at
    it (a subclass per store says its protocol and makes its client)."""

    endpoint: str
    env: dict[str, str]
    #: fsspec's protocol, the scheme of the store's URIs (``s3``, ``gs``).
    protocol: ClassVar[str]

    def bucket(self) -> str:
        """A new bucket's name (made)."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def fs(self) -> Any:
        """A client of the store's own, outside extract (made from the endpoint, not the
        environment)."""
        raise NotImplementedError


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
