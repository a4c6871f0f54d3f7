"""The exact command lines of the deployment files, as local processes.

The deployment files say how vLLM and the proxy are started in a container: ``compose.yaml`` (with
the image's ENTRYPOINT/CMD from ``deploy/docker/*.Dockerfile`` where a service does not set its
own) and the Helm chart's rendered pod spec. This module extracts, for each of them, the exact argv
and environment of the vLLM container and of the proxy container, so that a test can run them as
local processes against a tiny model and catch a wrong flag or environment variable without Docker
or a cluster.

- :func:`compose_commands` reads ``compose.yaml`` with the given variables (compose interpolation:
  ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}``, ``$$``).
- :func:`chart_commands` renders the chart (offline, through ``helm_python``) with a values file
  and overrides.
- :func:`localize` turns a container command into a local one: it only changes *values* (the
  interpreter path, ports, listen/upstream hosts, the ring directory, HF_HOME), never a flag or an
  environment variable's name, so a typo in the deployment files still shows up.

Each command is a ``(argv, env)`` tuple. ``env`` holds only what the deployment file sets (literal
values; ``valueFrom`` secrets are left out, compose pass-through variables are taken from the given
variables when present); run it on top of the local environment: ``{**os.environ, **env}``.
"""

from __future__ import annotations

import copy
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from vllm_hidden_state_proxy.protocol import RING_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
CHART_DIR = REPO / "deploy" / "helm" / "vllm-hidden-state"
DOCKER_DIR = REPO / "deploy" / "docker"

Command = tuple[list[str], dict[str, str]]

__all__ = [
    "CHART_DIR",
    "COMPOSE_FILE",
    "DOCKER_DIR",
    "REPO",
    "Command",
    "chart_commands",
    "chart_manifests",
    "compose_commands",
    "image_config",
    "interpolate",
    "load_compose",
    "localize",
]


# --------------------------------------------------------------------------------------------------
# Dockerfiles


def image_config(
    dockerfile: str | Path, build_args: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """ENTRYPOINT, CMD, USER, FROM and ARGs of a Dockerfile's final stage (parsed with
    ``dockerfile``).

    Returns ``{"from": str, "entrypoint": list|None, "cmd": list|None, "user": str|None,
    "env": dict, "args": dict}``. ``from`` is the base image with the ARGs declared before the
    first FROM substituted, as Docker does: their defaults, or ``build_args`` (``--build-arg``).
    ``args`` maps the final stage's ARGs to their defaults (None without one). Shell-form
    ENTRYPOINT/CMD become ``["/bin/sh", "-c", text]``, as Docker runs them.
    """
    import dockerfile as dockerfile_parser

    commands = dockerfile_parser.parse_file(str(dockerfile))
    global_args: dict[str, str] = {}
    stage: list[Any] = []
    for command in commands:
        if command.cmd.upper() == "FROM":
            stage = []
        elif command.cmd.upper() == "ARG" and not stage:  # before the first FROM
            name, _, default = command.value[0].partition("=")
            global_args[name] = default
        stage.append(command)
    if not stage or stage[0].cmd.upper() != "FROM":
        raise ValueError(f"{dockerfile}: no FROM")
    global_args.update(build_args or {})
    config: dict[str, Any] = {
        "from": _substitute(stage[0].value[0], global_args),
        "entrypoint": None,
        "cmd": None,
        "user": None,
        "env": {},
        "args": {},
    }
    for command in stage[1:]:
        name = command.cmd.upper()
        if name in ("ENTRYPOINT", "CMD"):
            argv = (
                list(command.value) if command.json else ["/bin/sh", "-c", " ".join(command.value)]
            )
            config[name.lower()] = argv
        elif name == "USER":
            config["user"] = command.value[0]
        elif name == "ENV":
            values = list(command.value)
            config["env"].update(dict(zip(values[::2], values[1::2], strict=True)))
        elif name == "ARG":
            arg, equals, default = command.value[0].partition("=")
            config["args"][arg] = default if equals else None
    return config


def _substitute(text: str, args: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` in a FROM line (the forms Docker expands there)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), text)


# --------------------------------------------------------------------------------------------------
# compose


class InterpolationError(ValueError):
    pass


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose-spec variable interpolation of one string."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            depth, j = 1, i + 2
            while j < len(text) and depth:
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                j += 1
            if depth:
                raise InterpolationError(f"unterminated ${{ in {text!r}")
            out.append(_expand(text[i + 2 : j - 1], env))
            i = j
        else:
            match = _NAME.match(text, i + 1)
            if not match:
                raise InterpolationError(f"invalid $ in {text!r} (write $$ for a literal $)")
            out.append(env.get(match.group(0), ""))
            i = match.end()
    return "".join(out)


def _expand(body: str, env: Mapping[str, str]) -> str:
    match = _NAME.match(body)
    if not match:
        raise InterpolationError(f"invalid variable ${{{body}}}")
    name, rest = match.group(0), body[match.end() :]
    value = env.get(name)
    if rest == "":
        return value or ""
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            break
    else:
        raise InterpolationError(f"invalid variable ${{{body}}}")
    present = value is not None and (value != "" or ":" not in op)
    if op in (":-", "-"):
        return value if present else interpolate(arg, env)  # type: ignore[return-value]
    if op in (":?", "?"):
        if not present:
            raise InterpolationError(f"required variable {name} is missing: {arg}")
        return value  # type: ignore[return-value]
    return interpolate(arg, env) if present else ""


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def load_compose(
    env: Mapping[str, str] | None = None, path: str | Path = COMPOSE_FILE
) -> dict[str, Any]:
    """``compose.yaml`` with YAML merge keys resolved and variables interpolated from ``env``
    (``None``: no variables set, every default applies). ``x-*`` extension fields are dropped."""
    raw = yaml.safe_load(Path(path).read_text())
    doc = _interpolate_tree(raw, dict(env or {}))
    return {key: value for key, value in doc.items() if not str(key).startswith("x-")}


def _argv(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    return shlex.split(value) if isinstance(value, str) else [str(item) for item in value]


def _compose_service_command(
    service: Mapping[str, Any], env: Mapping[str, str], project_dir: Path
) -> Command:
    entrypoint = _argv(service.get("entrypoint"))
    command = _argv(service.get("command"))
    if entrypoint is None:  # the image's, from the Dockerfile the service builds
        build = service.get("build")
        if not isinstance(build, Mapping) or "dockerfile" not in build:
            raise ValueError("service sets no entrypoint and has no build.dockerfile")
        image = image_config(project_dir / build.get("context", ".") / build["dockerfile"])
        entrypoint = image["entrypoint"] or []
        if command is None:  # Docker: the image's CMD applies only with the image's ENTRYPOINT
            command = image["cmd"] or []
    command = command or []
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        pairs = [item.split("=", 1) if "=" in item else [item, None] for item in environment]
        environment = dict(pairs)
    container_env: dict[str, str] = {}
    for key, value in environment.items():
        if value is None:  # pass-through: set only when the variable is set where compose runs
            if key in env:
                container_env[key] = env[key]
        else:
            container_env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return entrypoint + command, container_env


def compose_commands(
    env: Mapping[str, str] | None = None,
    *,
    service: str = "proxy",
    path: str | Path = COMPOSE_FILE,
) -> dict[str, Command]:
    """The vLLM and proxy command lines of one compose profile.

    ``service`` is the proxy service: ``"proxy"`` (GPU, ``docker compose --profile gpu up``) or
    ``"proxy-cpu"`` (``docker compose --profile cpu up``). The vLLM service is the one it
    depends on.
    ``env`` holds the variables compose would see (shell or ``.env``), e.g. ``{"MODEL": ...,
    "VLLM_EXTRA_ARGS": ...}``. Returns ``{"vllm": (argv, env), "proxy": (argv, env)}``.
    """
    variables = dict(env or {})
    doc = load_compose(variables, path)
    services = doc["services"]
    proxy = services[service]
    depends = proxy.get("depends_on") or {}
    names = list(depends)  # the short (list) and long (mapping) forms alike
    if len(names) != 1:
        raise ValueError(f"{service} must depend on exactly one (vLLM) service, not {names}")
    project_dir = Path(path).resolve().parent
    return {
        "vllm": _compose_service_command(services[names[0]], variables, project_dir),
        "proxy": _compose_service_command(proxy, variables, project_dir),
    }


# --------------------------------------------------------------------------------------------------
# Helm chart


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), dict):
            result[key] = _deep_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def chart_values(
    values_file: str | Path | None = None, values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """User values as ``helm -f values_file --set ...`` would pass them (file, then overrides)."""
    merged: dict[str, Any] = {}
    if values_file is not None:
        merged = yaml.safe_load(Path(values_file).read_text()) or {}
    return _deep_merge(merged, values or {})


def chart_manifests(
    values_file: str | Path | None = None,
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "smoke",
    namespace: str = "default",
    chart_dir: str | Path = CHART_DIR,
) -> dict[str, list[dict[str, Any]]]:
    """``helm template``: template path -> the objects it renders (NOTES.txt excluded)."""
    import helm_python

    with helm_python.Chart.load(str(chart_dir)) as chart:
        rendered = chart.render(
            chart_values(values_file, values), name=release, namespace=namespace
        )
    manifests: dict[str, list[dict[str, Any]]] = {}
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        docs = [doc for doc in yaml.safe_load_all(text) if doc]
        if docs:
            manifests[template] = docs
    return manifests


def _container_command(container: Mapping[str, Any]) -> Command:
    if "command" not in container:
        raise ValueError(f"container {container.get('name')} relies on the image's ENTRYPOINT")
    argv = [str(item) for item in container["command"]] + [
        str(item) for item in container.get("args", [])
    ]
    env = {item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item}
    return argv, env


def chart_commands(
    values_file: str | Path | None = None,
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "smoke",
    namespace: str = "default",
) -> dict[str, Command]:
    """The container command lines of the rendered chart.

    Returns ``{"vllm": ..., "proxy": ...}`` from the Deployment's pod and ``"test"``: the
    ``helm test`` pod (one flagged chat request through the Service; exits non-zero unless a vector
    of ``tests.hiddenSize`` floats comes back). ``values`` override the file, e.g.
    ``{"model": "/path/to/tiny-model", "maxModelLen": None, "tests": {"hiddenSize": 64}}``.
    """
    manifests = chart_manifests(values_file, values=values, release=release, namespace=namespace)
    objects = [doc for docs in manifests.values() for doc in docs]
    deployments = [doc for doc in objects if doc["kind"] == "Deployment"]
    if len(deployments) != 1:
        raise ValueError(f"expected one Deployment, got {len(deployments)}")
    containers = {c["name"]: c for c in deployments[0]["spec"]["template"]["spec"]["containers"]}
    tests = [
        doc
        for doc in objects
        if doc["kind"] == "Pod"
        and doc["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    if len(tests) != 1:
        raise ValueError(f"expected one helm test pod, got {len(tests)}")
    return {
        "vllm": _container_command(containers["vllm"]),
        "proxy": _container_command(containers["proxy"]),
        "test": _container_command(tests[0]["spec"]["containers"][0]),
    }


# --------------------------------------------------------------------------------------------------
# Running them locally

_URL_ENV = ("PROXY_URL",)


def _rewrite_url(url: str, host: str, ports: Mapping[int, int]) -> str:
    parts = urlsplit(url)
    if not parts.scheme or parts.port is None:
        return url
    netloc = f"{host}:{ports.get(parts.port, parts.port)}"
    return urlunsplit(parts._replace(netloc=netloc))


def localize(
    command: Command,
    *,
    ring_dir: str | Path,
    ports: Mapping[int, int] | None = None,
    python: str = sys.executable,
    bin_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    hf_home: str | Path | None = None,
) -> Command:
    """A container command as a local process: same flags and variable names, local values.

    - ``python3``/``python`` as argv[0] -> ``python``; another bare program name -> ``bin_dir/name``
      when given (e.g. the venv's ``hidden-state-proxy``);
    - ``--port N`` and the port of every ``http(s)://host:N`` value (argv or PROXY_URL) ->
      ``ports[N]``; the host of those URLs and the value of ``--host`` -> ``host`` (everything runs
      on loopback, like the two containers of one pod);
    - the container's ring directory (its HIDDEN_STATE_PROXY_RING_DIR, in argv and env) ->
      ``ring_dir``;
    - HF_HOME -> ``hf_home``, or removed when ``hf_home`` is None.
    """
    argv, env = list(command[0]), dict(command[1])
    ports = dict(ports or {})
    container_ring = env.get(RING_DIR_ENV)
    if argv and argv[0] in ("python3", "python"):
        argv[0] = python
    elif argv and bin_dir is not None and "/" not in argv[0]:
        argv[0] = str(Path(bin_dir) / argv[0])
    for i in range(1, len(argv)):
        flag, value = argv[i - 1], argv[i]
        if flag == "--port" and value.isdigit():
            argv[i] = str(ports.get(int(value), int(value)))
        elif flag == "--host":
            argv[i] = host
        elif flag == "--ring-dir" or (container_ring is not None and value == container_ring):
            argv[i] = str(ring_dir)
        elif re.match(r"^https?://", value):
            argv[i] = _rewrite_url(value, host, ports)
    if container_ring is not None:
        env[RING_DIR_ENV] = str(ring_dir)
    for key in _URL_ENV:
        if key in env:
            env[key] = _rewrite_url(env[key], host, ports)
    if hf_home is None:
        env.pop("HF_HOME", None)
    else:
        env["HF_HOME"] = str(hf_home)
    return argv, env
