"""Where ``extract`` reads its corpus and writes its dataset: a local path, as always, or an
object store's URI (``s3://bucket/prefix``, ``gs://``, ``az://``, any fsspec protocol whose
package is installed: the ``object-store`` extra brings fsspec and s3fs).

:func:`location` turns INPUT or ``--output`` into a :class:`~pathlib.Path` (a plain path or a
``file://`` URI: nothing changes for it) or a :class:`StorePath`, which answers the few calls of
pathlib's that extract makes (``exists``, ``is_dir``, ``iterdir``, ``glob``, ``open``,
``read_text``, ``unlink``, ``replace``, ``/``, ``name``), so one code reads the corpus and
writes the dataset on both. Where an object store differs:

- no links and no directories: a directory is a prefix, there while an object is under it;
- no exclusive create (``O_EXCL``): :meth:`StorePath.create` checks that nothing is at the name
  first (as on a local disk, nothing stops two runs on one ``--output`` at once);
- an object appears whole when its upload ends: a part (written as ``.part-*.tmp``, then copied
  to its name and the copy removed) and the manifest are whole or absent, as locally; the
  errors file appears when the run ends (locally it grows line by line);
- Parquet is read through the store's file objects (:func:`parquet_source`).

Credentials and endpoints are the store library's own: for S3 (s3fs on botocore) the
``AWS_*`` variables (``AWS_ENDPOINT_URL`` for an S3-compatible store), ``~/.aws/config`` and
``credentials``, an instance's or a pod's role; for GCS (gcsfs) Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's, a VM's or a pod's service account) and
``STORAGE_EMULATOR_HOST`` for an emulator; fsspec's configuration (``FSSPEC_S3_*``,
``FSSPEC_GS_*`` variables, ``~/.config/fsspec/``) too. Never on the command line, where ``ps``
and the manifest's ``command_line`` would show them. Both are tested (moto's S3,
gcp-storage-emulator's GCS), with the same calls: nothing here depends on the protocol.

fsspec is imported only for a URI (the proxy and the client module never import it).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: ``scheme://``: a URI; ``file://`` (and a path without one) is local.
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_LOCAL_SCHEMES = frozenset({"file", "local"})
#: What a reader of a store's object asks it for at once (each read is a request).
_READ_BYTES = 8 * 1024 * 1024
EXTRA_HINT = "pip install 'vllm-hidden-state-proxy[object-store]'"


class StorageError(Exception):
    """A URI that cannot be used (its library missing, a protocol fsspec does not know)."""


class StorePath:
    """A file or a prefix in an object store (see the module docstring)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/")

    # -- names ---------------------------------------------------------------------------------

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and (other.fs, other.path) == (self.fs, self.path)

    def __hash__(self) -> int:
        return hash(self.path)

    def __lt__(self, other: StorePath) -> bool:
        return self.path < other.path

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.fs, f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    # -- what is there -------------------------------------------------------------------------

    def _fresh(self) -> None:
        """Forget the listings the filesystem keeps (s3fs caches them): the run adds objects."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.path)

    def exists(self) -> bool:
        self._fresh()
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        self._fresh()
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        self._fresh()
        return bool(self.fs.isfile(self.path))

    def is_symlink(self) -> bool:
        return False  # object stores have none

    def iterdir(self) -> Iterator[StorePath]:
        self._fresh()
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return iter(())
        own = self.path
        return iter(
            StorePath(self.fs, name) for name in (str(n).rstrip("/") for n in names) if name != own
        )

    def glob(self, pattern: str) -> Iterator[StorePath]:
        return (path for path in self.iterdir() if fnmatch.fnmatchcase(path.name, pattern))

    # -- reading and writing -------------------------------------------------------------------

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """A prefix: nothing to make in a bucket, but the bucket must be there (s3fs would
        make a bucket of a misspelt name)."""
        bucket = self.path.split("/", 1)[0]
        if self.fs.root_marker == "" and "/" in self.path and not self.fs.exists(bucket):
            raise FileNotFoundError(f"the bucket {bucket} does not exist")
        self.fs.makedirs(self.path, exist_ok=True)

    def open(self, mode: str = "r", encoding: str | None = None) -> IO[Any]:
        if mode == "rb":  # io's reader: fsspec's files take no size in readline()
            return io.BufferedReader(self.fs.open(self.path, mode), _READ_BYTES)
        if "b" in mode:
            return self.fs.open(self.path, mode)  # type: ignore[no-any-return]
        return self.fs.open(self.path, mode, encoding=encoding or "utf-8")  # type: ignore[no-any-return]

    def read_text(self, encoding: str = "utf-8") -> str:
        return bytes(self.fs.cat_file(self.path)).decode(encoding)

    def create(self, mode: str = "w") -> IO[Any]:
        """A new object: ``FileExistsError`` if one is at the name (checked, not atomic)."""
        if self.exists():
            raise FileExistsError(str(self))
        return self.open(mode.replace("x", "w"))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def replace(self, target: StorePath) -> StorePath:
        """Copy to ``target`` (whole, as each object), then remove this one."""
        self.fs.copy(self.path, target.path)
        self.fs.rm_file(self.path)
        return target


#: What INPUT and ``--output`` are once read: a local path or an object store's.
Location = Path | StorePath


def location(text: str | Path) -> Location:
    """``text`` as a :class:`~pathlib.Path` (a path, ``file://``) or a :class:`StorePath`
    (another scheme); :class:`StorageError` when its library is missing."""
    if isinstance(text, Path):
        return text
    found = _SCHEME.match(text)
    if found is None:
        return Path(text)
    if found.group("scheme").lower() in _LOCAL_SCHEMES:
        return Path(text[found.end() :] or "/")
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{text}: object stores need fsspec: {EXTRA_HINT}") from None
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except ImportError as exc:  # the protocol's own package (s3fs, gcsfs, adlfs)
        raise StorageError(f"{text}: {exc}") from None
    except ValueError as exc:  # a protocol fsspec does not know
        raise StorageError(f"{text}: {exc}") from None
    return StorePath(fs, str(path))


def replace(source: Location, target: Location) -> None:
    """Put ``source`` at ``target``'s name: ``os.replace`` locally, a copy then a removal in a
    store (each object whole)."""
    if isinstance(source, Path) and isinstance(target, Path):
        os.replace(source, target)
    elif isinstance(source, StorePath) and isinstance(target, StorePath):
        source.replace(target)
    else:
        raise TypeError(f"{source} and {target} are not in one place")


@contextlib.contextmanager
def parquet_source(path: Location) -> Iterator[Any]:
    """What pyarrow's Parquet readers take for ``path``: the path itself when local (read as
    before), an open file of the store's otherwise."""
    if isinstance(path, Path):
        yield path
        return
    with path.open("rb") as file:
        yield file
