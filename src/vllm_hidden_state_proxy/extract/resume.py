"""What ``--resume`` checks before it adds to a dataset: every setting that changes the
vectors, against the manifest and against each part's own (its schema's metadata), and each
part's columns against this run's. A mismatch is refused by name; nothing is sent."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vllm_hidden_state_proxy.extract.dataset import SETTINGS_KEY, part_files
from vllm_hidden_state_proxy.extract.storage import Location, parquet_source

#: What the dataset must share with a run that resumes it: what decides its vectors (the
#: request body's other fields, ``--extra-body``, included: a chat template's arguments, a
#: temperature) and its columns.
RESUME_KEYS = (
    "model", "hidden_size", "layers", "pooling", "spans", "dtype", "max_tokens", "n",
    "extra_body",
)  # fmt: skip
#: The keys a manifest of an earlier release may lack (read as ``None``).
OPTIONAL_KEYS = ("extra_body",)


class ResumeRefused(Exception):
    """The dataset was made otherwise than this run would: nothing is sent."""


def settings_of(plan: Mapping[str, Any]) -> dict[str, Any]:
    return {key: plan[key] for key in RESUME_KEYS}


def _differing(made: Mapping[str, Any], plan: Mapping[str, Any]) -> str | None:
    differing = [key for key in RESUME_KEYS if made.get(key) != plan[key]]
    if not differing:
        return None
    return ", ".join(f"{key} ({made.get(key)!r}, now {plan[key]!r})" for key in differing)


def _extra_body_of_command_line(manifest: Mapping[str, Any]) -> Any:
    """A manifest of an earlier release has no ``extra_body``: its first run's command line
    says what it was (``None`` if it gave none, or it cannot be read)."""
    runs = manifest.get("runs") or [{}]
    words = runs[0].get("command_line") if isinstance(runs[0], dict) else None
    if not isinstance(words, list):
        return None
    for i, word in enumerate(words):
        given = None
        if word == "--extra-body" and i + 1 < len(words):
            given = words[i + 1]
        elif isinstance(word, str) and word.startswith("--extra-body="):
            given = word.split("=", 1)[1]
        if isinstance(given, str):
            try:
                return json.loads(given) or None
            except ValueError:
                return None
    return None


def check_manifest(
    directory: Location, manifest: Mapping[str, Any], plan: Mapping[str, Any]
) -> None:
    if "extra_body" not in manifest:
        manifest = {**manifest, "extra_body": _extra_body_of_command_line(manifest)}
    differing = _differing(manifest, plan)
    if differing is not None:
        raise ResumeRefused(f"--resume: {directory}'s dataset was made with other {differing}")


def check_parts(directory: Location, schema: Any, plan: Mapping[str, Any]) -> None:
    """Each part's settings (when it carries them: parts of earlier releases do not) and its
    columns, which must be this run's ``schema``'s."""
    import pyarrow.parquet as pq

    expected = schema.remove_metadata()
    for part in part_files(directory):
        try:
            with parquet_source(part) as source:
                found = pq.read_schema(source)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ResumeRefused(
                f"--resume: {part} cannot be read ({exc}): not a part extract finished; move "
                "it away (its ids are sent again)"
            ) from None
        made = (found.metadata or {}).get(SETTINGS_KEY)
        if made is not None:
            try:
                settings = json.loads(made)
            except ValueError:
                settings = {}
            differing = _differing(settings if isinstance(settings, dict) else {}, plan)
            if differing is not None:
                raise ResumeRefused(f"--resume: {part} was made with other {differing}")
        columns = found.remove_metadata()
        if not columns.equals(expected):
            theirs = {field.name: str(field.type) for field in columns}
            ours = {field.name: str(field.type) for field in expected}
            differing = "; ".join(
                f"{name}: {theirs.get(name, 'none')}, now {ours.get(name, 'none')}"
                for name in sorted(set(theirs) | set(ours), key=str)
                if theirs.get(name) != ours.get(name)
            )
            raise ResumeRefused(f"--resume: {part} has other columns than this run ({differing})")
