"""The exact container command lines of compose.yaml and the Helm chart, run as local processes.

Each case starts vLLM with the vLLM container's command line and the proxy with the proxy
container's (only values are localised: interpreter path, ports, host, ring directory), then
sends one flagged request and, for the chart, runs the ``helm test`` pod's script. This catches a
wrong flag or environment variable in the deployment files without Docker. Each case starts its
own vLLM server, so these run in their own pytest session (marker ``own_server``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.commands import CHART_DIR, chart_commands, compose_commands, localize
from tests.e2e.reference import Reference, assert_matches
from tests.e2e.server import (
    SERVED_MODEL_NAME,
    STARTUP_TIMEOUT,
    TEST_VLLM_ARGS,
    stack_environment,
    wait_healthy,
)
from vllm_hidden_state_proxy.processes import free_port, one_vllm_at_a_time, stop_process_group

pytestmark = pytest.mark.own_server

VENV_BIN = Path(os.sys.executable).parent  # type: ignore[attr-defined]


@contextlib.contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        stop_process_group(process, argv[0], grace=60)


def _run_pair(
    commands: dict[str, Any], work: Path, reference: Reference, layers: list[int] | None = None
) -> dict[str, Any]:
    ring_dir = Path("/dev/shm") / f"hsp-deploy-{os.getpid()}-{free_port()}"
    ports = {8001: free_port(), 8000: free_port()}
    vllm_argv, vllm_env = localize(commands["vllm"], ring_dir=ring_dir, ports=ports)
    proxy_argv, proxy_env = localize(
        commands["proxy"], ring_dir=ring_dir, ports=ports, bin_dir=VENV_BIN
    )
    proxy_url = f"http://127.0.0.1:{ports[8000]}"
    try:
        with (
            one_vllm_at_a_time(),
            _process(vllm_argv, {**stack_environment(), **vllm_env}, work / "vllm.log") as vllm,
        ):
            wait_healthy(
                f"http://127.0.0.1:{ports[8001]}/health", vllm, STARTUP_TIMEOUT, work / "vllm.log"
            )
            with _process(proxy_argv, {**os.environ, **proxy_env}, work / "proxy.log") as proxy:
                wait_healthy(proxy_url + "/health", proxy, 60, work / "proxy.log")
                from openai import OpenAI

                client = OpenAI(base_url=proxy_url + "/v1", api_key="unused", max_retries=0)
                model = client.models.list().data[0].id
                messages: Any = [{"role": "user", "content": "Deployment smoke test."}]
                response = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_completion_tokens=1,
                    extra_body={"kv_transfer_params": {"return_last_hidden_state": True}},
                )
                vector = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
                ids = reference.chat_token_ids(messages)
                assert_matches(vector, reference.last_hidden_state(ids))
                if layers:  # the layers the deployment's values set, each checked
                    kv = {"return_last_hidden_state": True, "last_hidden_state_layers": layers}
                    response = client.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_completion_tokens=1,
                        extra_body={"kv_transfer_params": kv},
                    )
                    by_layer = response.model_dump()["kv_transfer_params"][
                        "last_hidden_states_by_layer"
                    ]
                    for label, layer_vector in by_layer.items():
                        expected = reference.layer_vector(ids, int(label), "last")
                        assert_matches(layer_vector, expected)
                result: dict[str, Any] = {"proxy_url": proxy_url, "ports": ports, "ring": ring_dir}
                if "test" in commands:
                    test_argv, test_env = localize(
                        commands["test"], ring_dir=ring_dir, ports=ports, bin_dir=VENV_BIN
                    )
                    done = subprocess.run(
                        test_argv,
                        env={**os.environ, **test_env},
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                    assert done.returncode == 0, done.stdout + done.stderr
                return result
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)


def _without_served_model_name(args: list[str]) -> list[str]:
    i = args.index("--served-model-name")
    return args[:i] + args[i + 2 :]


def test_helm_chart_container_commands_serve_a_vector(
    tiny_model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    commands = chart_commands(
        CHART_DIR / "ci" / "cpu-values.yaml",
        values={
            "model": str(tiny_model_dir),
            "servedModelName": SERVED_MODEL_NAME,
            "maxModelLen": None,
            "extraArgs": _without_served_model_name(TEST_VLLM_ARGS),
            "vllm": {"env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"}]},
            "tests": {"hiddenSize": reference.hidden_size},
            "hiddenStateLayers": "1,-1",
        },
    )
    assert commands["vllm"][1]["HIDDEN_STATE_PROXY_LAYERS"] == "1,-1"
    # vLLM binds loopback in the pod, as the chart promises.
    argv = commands["vllm"][0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    _run_pair(commands, tmp_path, reference, layers=[1, -1])


def test_compose_cpu_container_commands_serve_a_vector(
    tiny_model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    commands = compose_commands(
        {
            "MODEL": str(tiny_model_dir),
            "VLLM_EXTRA_ARGS": shlex.join(TEST_VLLM_ARGS),
            "VLLM_CPU_KVCACHE_SPACE": "2",
        },
        service="proxy-cpu",
    )
    _run_pair(commands, tmp_path, reference)
