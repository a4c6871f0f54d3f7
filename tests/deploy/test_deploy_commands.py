"""tests/deploy/commands.py: the exact container command lines, and that vLLM accepts them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.commands import (
    CHART_DIR,
    InterpolationError,
    chart_commands,
    compose_commands,
    image_config,
    interpolate,
    localize,
)
from tests.deploy.deploy_helpers import VALUES_FILES, flag_value

VLLM_MODULE = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CPU_VALUES = CHART_DIR / "ci" / "cpu-values.yaml"


# ---------------------------------------------------------------------------------------------
# compose interpolation


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A}", {"A": "x"}, "x"),
        ("$A/b", {"A": "x"}, "x/b"),
        ("${A}", {}, ""),
        ("${A:-d}", {}, "d"),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("${A:+alt}", {"A": "x"}, "alt"),
        ("${A:+alt}", {"A": ""}, ""),
        ("${A:-${B:-inner}}", {}, "inner"),
        ("$$A ${A}", {"A": "x"}, "$A x"),
        ("--model ${MODEL:-Qwen/Qwen3-0.6B} ${X:-}", {}, "--model Qwen/Qwen3-0.6B "),
    ],
)
def test_interpolate(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


@pytest.mark.parametrize("text", ["${A:?set A}", "${A", "$-", "${1A}"])
def test_interpolate_errors(text: str) -> None:
    with pytest.raises(InterpolationError):
        interpolate(text, {})


# ---------------------------------------------------------------------------------------------
# compose


def test_compose_commands_gpu() -> None:
    commands = compose_commands({"MODEL": "/models/tiny", "VLLM_EXTRA_ARGS": "--dtype float32"})
    vllm_argv, vllm_env = commands["vllm"]
    assert vllm_argv == [
        *VLLM_MODULE,
        "--model",
        "/models/tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--dtype",
        "float32",
    ]
    assert vllm_env["HIDDEN_STATE_PROXY_RING_DIR"] == "/run/vllm-hidden-states"
    proxy_argv, proxy_env = commands["proxy"]
    # compose gives no entrypoint: it is the image's, read from deploy/docker/proxy.Dockerfile.
    assert (
        proxy_argv[:2]
        == image_config(CHART_DIR.parents[1] / "docker" / "proxy.Dockerfile")["entrypoint"]
        == ["hidden-state-proxy", "proxy"]
    )
    assert proxy_argv[2:] == [
        "--upstream",
        "http://vllm:8001",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--ring-dir",
        "/run/vllm-hidden-states",
    ]
    assert proxy_env == {
        "HIDDEN_STATE_PROXY_RING_DIR": "/run/vllm-hidden-states",
        "HIDDEN_STATE_PROXY_RING_DIR_MODE": "0770",
    }


def test_compose_commands_cpu() -> None:
    commands = compose_commands({}, service="proxy-cpu")
    assert flag_value(commands["proxy"][0], "--upstream") == "http://vllm-cpu:8001"
    assert commands["vllm"][0][:3] == VLLM_MODULE
    assert commands["vllm"][1]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert (
        compose_commands({"VLLM_CPU_KVCACHE_SPACE": "2"}, service="proxy-cpu")["vllm"][1][
            "VLLM_CPU_KVCACHE_SPACE"
        ]
        == "2"
    )


# ---------------------------------------------------------------------------------------------
# chart


def test_chart_commands_cpu_values() -> None:
    commands = chart_commands(CPU_VALUES, values={"model": "/models/tiny", "maxModelLen": None})
    vllm_argv, vllm_env = commands["vllm"]
    assert vllm_argv == [
        *VLLM_MODULE,
        "--model",
        "/models/tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "1",
    ]
    assert vllm_env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "HF_TOKEN" not in vllm_env
    proxy_argv, proxy_env = commands["proxy"]
    assert proxy_argv == [
        "hidden-state-proxy",
        "proxy",
        "--upstream",
        "http://127.0.0.1:8001",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--ring-dir",
        "/run/vllm-hidden-states",
        "--vector-timeout",
        "30",
        "--drain-timeout",
        "25",
    ]
    assert "HIDDEN_STATE_PROXY_API_KEY" not in proxy_env  # a secretKeyRef: not a literal
    assert proxy_env["HIDDEN_STATE_PROXY_RING_DIR"] == vllm_env["HIDDEN_STATE_PROXY_RING_DIR"]
    test_argv, test_env = commands["test"]
    assert test_argv[:2] == ["python3", "-c"]
    assert test_env["MODEL"] == "/models/tiny"


def test_chart_commands_leave_out_secrets() -> None:
    _, env = chart_commands(VALUES_FILES["tp2"])["vllm"]
    assert "HF_TOKEN" not in env  # valueFrom: not a literal


# ---------------------------------------------------------------------------------------------
# localize


def _flags(argv: list[str]) -> list[tuple[int, str]]:
    return [(i, a) for i, a in enumerate(argv) if a.startswith("-")]


@pytest.mark.parametrize("source", ["compose", "compose-cpu", "chart-cpu"])
def test_localize_changes_values_not_flags(source: str, tmp_path: Path) -> None:
    if source == "chart-cpu":
        commands = chart_commands(CPU_VALUES)
    else:
        commands = compose_commands({}, service="proxy-cpu" if source == "compose-cpu" else "proxy")
    ring = tmp_path / "ring"
    ports = {8001: 18001, 8000: 18000}
    vllm = localize(commands["vllm"], ring_dir=ring, ports=ports, python="/venv/bin/python")
    proxy = localize(commands["proxy"], ring_dir=ring, ports=ports, bin_dir="/venv/bin")
    for before, after in ((commands["vllm"], vllm), (commands["proxy"], proxy)):
        assert _flags(before[0]) == _flags(after[0])
        assert set(after[1]) == set(before[1]) - {"HF_HOME"}
    assert vllm[0][:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(vllm[0], "--port") == "18001"
    assert flag_value(vllm[0], "--host") == "127.0.0.1"
    assert vllm[1]["HIDDEN_STATE_PROXY_RING_DIR"] == str(ring)
    assert proxy[0][0] == "/venv/bin/hidden-state-proxy"
    assert flag_value(proxy[0], "--upstream") == "http://127.0.0.1:18001"
    assert flag_value(proxy[0], "--port") == "18000"
    assert flag_value(proxy[0], "--ring-dir") == str(ring)
    assert proxy[1]["HIDDEN_STATE_PROXY_RING_DIR"] == str(ring)


def test_localize_test_pod_and_hf_home(tmp_path: Path) -> None:
    commands = chart_commands(CPU_VALUES)
    argv, env = localize(commands["test"], ring_dir=tmp_path, ports={8000: 18000})
    assert argv[0] == sys.executable
    assert env["PROXY_URL"] == "http://127.0.0.1:18000"
    _, vllm_env = localize(commands["vllm"], ring_dir=tmp_path, hf_home=tmp_path / "hf")
    assert vllm_env["HF_HOME"] == str(tmp_path / "hf")


# ---------------------------------------------------------------------------------------------
# vLLM accepts every command line the deployment files build

_PARSE_SCRIPT = r"""
import contextlib, importlib.util, io, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # older layout
    from vllm.entrypoints.openai.cli_args import make_arg_parser
assert importlib.util.find_spec(sys.argv[1]) is not None, "no module " + sys.argv[1]
parser = make_arg_parser(FlexibleArgumentParser())
out = {}
for name, args in json.loads(sys.stdin.read()).items():
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = parser.parse_args(args)
    except SystemExit:
        out[name] = {"error": errors.getvalue()[-2000:]}
        continue
    out[name] = {"model": parsed.model, "host": parsed.host, "port": parsed.port,
                 "tensor_parallel_size": parsed.tensor_parallel_size}
print(json.dumps(out))
"""


def _all_vllm_argvs() -> dict[str, list[str]]:
    argvs = {
        "compose": compose_commands({"VLLM_EXTRA_ARGS": "--max-model-len 8192"})["vllm"][0],
        "compose-cpu": compose_commands({}, service="proxy-cpu")["vllm"][0],
    }
    for name, path in VALUES_FILES.items():
        argvs[f"chart-{name}"] = chart_commands(path)["vllm"][0]
    return argvs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_parses_every_deployment_command_line() -> None:
    argvs = _all_vllm_argvs()
    for argv in argvs.values():
        assert argv[:3] == VLLM_MODULE
    payload = {name: argv[3:] for name, argv in argvs.items()}
    # A misspelt flag must be rejected by the same parser, so the check can fail.
    payload["misspelt"] = ["--model", "m", "--tensor-paralel-size", "2"]
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_SCRIPT, VLLM_MODULE[2]],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert "--tensor-paralel-size" in parsed.pop("misspelt")["error"]
    assert {name: "error" in out for name, out in parsed.items()} == dict.fromkeys(argvs, False)
    assert parsed["chart-tp2"] == {
        "model": "Qwen/Qwen3-8B",
        "host": "127.0.0.1",
        "port": 8001,
        "tensor_parallel_size": 2,
    }
    assert parsed["chart-cpu"]["host"] == "127.0.0.1"
    assert parsed["compose"]["host"] == "0.0.0.0"
