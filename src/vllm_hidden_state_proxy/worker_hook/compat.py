"""Which vLLM the hook runs on: decided by the runner's structure, not by its version number.

vLLM ships a release every few weeks and the hook reads its model runner's internals, so a
version allow-list would either turn the hook off on every new release (silently, before any
engine exists to say so) or let it run blind. Instead, every vLLM goes through the same
startup checks, in the worker, where a failure note can name the engine:

- **at construction** of a runner (its wrapped ``__init__``, :func:`class_problems`): each
  method the hook wraps is reached through a wrapper (a subclass override that does not call
  the base method would bypass it), and the vLLM classes whose fields the hook reads
  (``SchedulerOutput``, ``NewRequestData`` and the view's own, e.g. ``ExecuteModelState``) have
  those fields;
- **when the ring is created** (``RunnerView.check``): the runner instance has the state the
  view reads, with the right types.

If they pass on a version the hook was not tested with, it runs and logs that once; if not, the
engine's failure note names the vLLM version and the missing piece, and is marked fatal
(``/health`` 503, ``serve`` exits). ``HIDDEN_STATE_PROXY_HOOK`` overrides the default
(:attr:`.settings.HookSettings.hook_mode`):

- unset, empty or ``auto``: as above;
- ``0``/``false``/``no``/``off``: the hook wraps nothing (no ring, no note: vLLM runs as
  without the package);
- ``1``/``true``/``yes``/``on``: the hook is *required*: as ``auto``, and in addition every
  failure to start (a ring that cannot be created, say) is fatal too, not only refused settings
  and an incompatible vLLM. It cannot make an incompatible vLLM work.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from typing import Any

#: vLLM minor versions whose runner internals this hook was written and tested against.
TESTED_VLLM_MINOR_VERSIONS = ("0.32", "0.33", "0.34")

#: The methods the hook must see run on every runner (``__init__`` is wrapped as well, to run
#: these checks; it is not needed afterwards).
NEEDED_METHODS = ("load_model", "initialize_kv_cache", "execute_model", "sample_tokens")

#: Marks a function as one of the hook's wrappers.
WRAPPED_ATTR = "_hidden_state_proxy_wrapped"


def vllm_version() -> str:
    try:
        import vllm
    except Exception:  # the hook runs inside vLLM; this only guards odd test environments
        return "unknown"
    return str(getattr(vllm, "__version__", "unknown"))


def is_tested_version(version: str) -> bool:
    return any(
        version == minor or version.startswith(minor + ".") for minor in TESTED_VLLM_MINOR_VERSIONS
    )


def describe_vllm(version: str | None = None) -> str:
    """``"vLLM 0.32.0"``, or with ``(untested)`` for a version not in the tested list."""
    version = vllm_version() if version is None else version
    if is_tested_version(version):
        return f"vLLM {version}"
    return f"vLLM {version} (untested by this hook)"


def missing_fields(cls: Any, names: Collection[str]) -> list[str]:
    """``names`` that are not fields of the dataclass or named tuple ``cls``."""
    fields = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "_fields", ()))
    return [name for name in names if name not in fields]


def _calls_base(function: Any, name: str) -> bool:
    """Whether ``function`` (an override of ``name``) calls ``super().name``: then a wrapper on
    the base method still runs. Read from its byte code's names, which ``super().name(...)``
    always puts there; no source file is needed."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and "super" in code.co_names and name in code.co_names


def unwrapped_methods(runner_cls: type, names: Sequence[str] = NEEDED_METHODS) -> list[str]:
    """Why each of ``names`` that would not pass through a hook wrapper on ``runner_cls``.

    Walks the MRO: the first definition must be a wrapper, or an override that calls the base
    method, in which case the next definition is checked the same way.
    """
    problems = []
    for name in names:
        if getattr(runner_cls, name, None) is None:
            problems.append(f"{runner_cls.__name__} has no method {name}")
            continue
        for owner in runner_cls.__mro__:
            function = owner.__dict__.get(name)
            if function is None:
                continue
            if getattr(function, WRAPPED_ATTR, False):
                break
            if not _calls_base(function, name):
                where = "" if owner is runner_cls else f" (inherited from {owner.__name__})"
                problems.append(
                    f"{runner_cls.__name__}.{name}{where} is not one the hook wraps, and it "
                    "does not call one"
                )
                break
        else:  # every definition called its base: none was a wrapper
            problems.append(f"{runner_cls.__name__}.{name} is not one the hook wraps")
    return problems


def scheduler_problems() -> list[str]:
    """What the hook reads of every step's ``SchedulerOutput`` and its new requests."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    problems = []
    for cls, names in (
        (SchedulerOutput, ("scheduled_new_reqs", "num_scheduled_tokens", "finished_req_ids")),
        (NewRequestData, ("req_id", "sampling_params")),
    ):
        missing = missing_fields(cls, names)
        if missing:
            problems.append(f"{cls.__name__} has no field {', '.join(missing)}")
    return problems
