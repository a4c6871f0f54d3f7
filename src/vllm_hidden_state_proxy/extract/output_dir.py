"""The output directory: which of its files are extract's, and what a run may do there.

extract's names are ``_manifest.json``, ``_errors.jsonl``, ``part-NNNNN.parquet`` and, while
written, ``.part-NNNNN.parquet.tmp`` and ``._manifest.json.*.tmp``. A directory is a dataset
when its ``_manifest.json`` is one extract wrote. Then:

- a new run (no ``--resume``) needs a directory that holds none of those names (other files may
  be there): it never writes onto, truncates or removes a file it did not make;
- ``--resume`` needs a dataset, or a directory with none of those names (it starts one): a part
  or an errors file without a manifest is no dataset of extract's;
- each of those names that is there must be a regular file (never a link, which writing or
  removing would follow to something else); a ``part-*.parquet`` of another name is refused;
- only in a dataset are the unfinished files of an earlier run removed, and the errors file
  replaced (the new one is created, never opened over an old one: ``dataset.create_file``).

Whatever does not fit is an :class:`OutputRefused`: a sentence, exit 2, nothing made.
"""

from __future__ import annotations

import json
from typing import IO, Any

from vllm_hidden_state_proxy.extract.dataset import (
    ERRORS,
    MANIFEST,
    PART,
    UNFINISHED_MANIFEST,
    UNFINISHED_PART,
    create_file,
)
from vllm_hidden_state_proxy.extract.resume import OPTIONAL_KEYS, RESUME_KEYS
from vllm_hidden_state_proxy.extract.storage import Location


class OutputRefused(Exception):
    """``--output`` cannot take this run (see the module docstring)."""


def _extracts(name: str) -> bool:
    """Whether ``name`` is one of extract's (or claims to be a part)."""
    return (
        name in (MANIFEST, ERRORS)
        or (name.startswith("part-") and name.endswith(".parquet"))
        or UNFINISHED_PART.fullmatch(name) is not None
        or UNFINISHED_MANIFEST.fullmatch(name) is not None
    )


def check_output_path(directory: Location) -> None:
    """``--output`` is a directory, or nothing yet (not a file, not a link to nothing)."""
    if directory.is_symlink() and not directory.exists():
        raise OutputRefused(f"--output {directory} is a symbolic link to nothing")
    if directory.exists() and not directory.is_dir():
        raise OutputRefused(f"--output {directory} is not a directory")


def _manifest(path: Location) -> dict[str, Any]:
    """The manifest, checked to be one extract wrote."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise OutputRefused(f"{path} cannot be read: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise OutputRefused(f"{path} is not JSON ({exc}): not a manifest extract wrote") from None
    if not isinstance(document, dict):
        raise OutputRefused(f"{path} is not an object: not a manifest extract wrote")
    for key in RESUME_KEYS:
        if key not in document and key not in OPTIONAL_KEYS:
            raise OutputRefused(f"{path} lacks '{key}': not a manifest extract wrote")
    runs = document.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        raise OutputRefused(f"{path}'s 'runs' is not a list of runs: not a manifest extract wrote")
    return document


def prepare_output(directory: Location, *, resume: bool) -> dict[str, Any] | None:
    """Check ``directory`` for this run (see the module docstring) and create it if need be;
    its manifest when it is a dataset."""
    check_output_path(directory)
    if not directory.exists():
        try:
            directory.mkdir(parents=True)
        except OSError as exc:
            raise OutputRefused(f"--output {directory} cannot be made: {exc}") from None
        return None
    try:
        found = sorted(path for path in directory.iterdir() if _extracts(path.name))
    except OSError as exc:
        raise OutputRefused(f"--output {directory} cannot be read: {exc}") from None
    for path in found:
        if path.is_symlink() or not path.is_file():
            raise OutputRefused(
                f"{path} is not a regular file (a link?): extract makes only files of its own "
                "there; move it away"
            )
        if path.name.startswith("part-") and not PART.fullmatch(path.name):
            raise OutputRefused(
                f"{path} is not a part extract wrote (part-NNNNN.parquet); readers of the "
                "directory would take it for one: move it away"
            )
    manifest = _manifest(directory / MANIFEST) if (directory / MANIFEST).exists() else None
    if manifest is None and found:
        names = ", ".join(path.name for path in found)
        raise OutputRefused(
            f"{directory} holds {names} but no {MANIFEST}: not a dataset extract made (or its "
            "manifest was removed); another --output, or move them away"
        )
    if manifest is not None and not resume:
        raise OutputRefused(
            f"{directory} already holds a dataset: --resume to add to it, or another --output"
        )
    return manifest


def remove_unfinished(directory: Location) -> list[Location]:
    """In a dataset, the files an earlier run left unfinished (never renamed: not part of it),
    removed; their names."""
    left = sorted(
        path
        for path in directory.iterdir()
        if UNFINISHED_PART.fullmatch(path.name) or UNFINISHED_MANIFEST.fullmatch(path.name)
    )
    for path in left:
        path.unlink()
    return left


def open_errors(directory: Location, *, replace: bool) -> IO[str]:
    """A new errors file (the dataset's last one removed first, when ``replace``)."""
    path = directory / ERRORS
    if replace:
        path.unlink(missing_ok=True)
    try:
        return create_file(path)
    except FileExistsError:
        raise OutputRefused(
            f"{path} appeared while the run started: is another one running?"
        ) from None
