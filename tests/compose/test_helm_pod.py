"""The Helm chart's pod for real (issue #29): ``helm template`` through the Helm SDK, and the
rendered Deployment's pod run in Docker as kubelet would run it (``tests/compose/pod.py`` says
what is simulated and what is not), with the images the compose test builds and the values in
``helm-pod-values.yaml`` over ``ci/cpu-values.yaml``.

Checked: the pod turns Ready by its own probes; the proxy requires the API key the chart
generates into a Secret (401 without it through the Service's port, a vector with it); vectors
through the Service's port, with the official OpenAI client and that key, equal Transformers';
the ``helm test`` pod's command (which checks the 401 too) passes against the Service; both
containers' preStop commands exist in their images; the containers run with the users, groups
and read-only root of the spec; only the proxy is reachable from outside the pod; the ring has
the permissions docs/deploy.md promises; and a killed engine turns the pod unready until
``restartPolicy: Always`` has brought vLLM back. Starts its own vLLM (in a container), so it
runs in the ``own_server`` session.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import OpenAI

from tests.compose import docker_host
from tests.compose.checks import (
    FLAG,
    KILL_ENGINE,
    PROXY_GID,
    PROXY_UID,
    RING_DIR,
    RING_DIR_MODE,
    RING_FILE_MODE,
    RING_STAT,
    expected_vector,
)
from tests.compose.pod import POD_EVENTS, POD_PHASES, Pod, run_to_completion
from tests.compose.stack import PROXY_IMAGE, VLLM_CPU_IMAGE, build_project
from tests.deploy.commands import CHART_DIR, chart_manifests
from tests.e2e.reference import Reference, assert_matches
from vllm_hidden_state_proxy.processes import one_vllm_at_a_time

pytestmark = [pytest.mark.e2e, pytest.mark.own_server, pytest.mark.timeout(1800)]

VALUES_FILE = Path(__file__).with_name("helm-pod-values.yaml")
BASE_VALUES = CHART_DIR / "ci" / "cpu-values.yaml"
RELEASE, NAMESPACE = "hsp", "helm-pod-test"
#: Longest wait for the pod to turn Ready (the chart's startup budget is an hour; the tiny model
#: loads in about a minute here).
READY_TIMEOUT = 600.0


def _values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(VALUES_FILE.read_text())
    return values


class HelmPod:
    """The running pod, its rendered objects and the model it serves."""

    def __init__(self, pod: Pod, manifests: dict[str, list[dict[str, Any]]], api_key: str) -> None:
        self.pod = pod
        self.api_key = api_key
        objects = [doc for docs in manifests.values() for doc in docs]
        self.test_pod = next(
            doc
            for doc in objects
            if doc["kind"] == "Pod" and doc["metadata"]["annotations"]["helm.sh/hook"] == "test"
        )
        self.model = _values()["servedModelName"]

    def client(self) -> OpenAI:
        return OpenAI(
            base_url=self.pod.service_url + "/v1", api_key=self.api_key, max_retries=0, timeout=120
        )

    def flagged_vector(self, text: str) -> list[float]:
        with self.client() as client:
            response = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": text}],
                max_completion_tokens=2,
                extra_body=FLAG,
            )
        vector: list[float] = response.model_dump()["kv_transfer_params"]["last_hidden_state"]
        return vector


def _wait_for(condition: Callable[[], bool], timeout: float, what: str, pod: Pod) -> float:
    """Poll ``condition`` until it holds; the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{pod.all_logs()}")
        time.sleep(0.5)
    return time.monotonic() - start


def _only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in objects if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _secrets(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The rendered Secrets, decoded, as the API server would hold them."""
    return {
        doc["metadata"]["name"]: {
            key: base64.b64decode(value).decode() for key, value in doc.get("data", {}).items()
        }
        for doc in objects
        if doc["kind"] == "Secret"
    }


@pytest.fixture(scope="module")
def helm_pod(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelmPod]:
    reason = docker_host.ensure_engine()
    if reason is not None:
        pytest.skip(reason)
    values = _values()
    # The values name the images the compose test builds, and the claim holds the tiny model.
    images = values["image"]
    assert f"{images['proxy']['repository']}:{images['proxy']['tag']}" == PROXY_IMAGE
    assert f"{images['vllm']['repository']}:{images['vllm']['tag']}" == VLLM_CPU_IMAGE
    assert Path(values["model"]).name == tiny_model_dir.name
    start = time.monotonic()
    build_project(
        tiny_model_dir, tmp_path_factory.mktemp("helm-pod"), f"hsp-helm-pod-{os.getpid()}"
    )
    POD_PHASES.append(
        ("images (the compose test's build; cached after it)", time.monotonic() - start)
    )
    manifests = chart_manifests(BASE_VALUES, values=values, release=RELEASE, namespace=NAMESPACE)
    objects = [doc for docs in manifests.values() for doc in docs]
    deployment = _only(objects, "Deployment")
    service = _only(objects, "Service")
    (port,) = service["spec"]["ports"]
    secrets = _secrets(objects)
    # The key the chart generated (the default: the Service is guarded).
    api_key = secrets[f"{RELEASE}-vllm-hidden-state-api-key"]["api-key"]
    pod = Pod(
        name=f"hsp-helm-pod-{os.getpid()}",
        spec=deployment["spec"]["template"]["spec"],
        claims={values["modelCache"]["existingClaim"]: tiny_model_dir.parent},
        secrets=secrets,
        service_name=service["metadata"]["name"],
        service_port=int(port["port"]),
        service_target=port["targetPort"],
        service_port_name=port["name"],
    )
    waited = time.monotonic()
    with one_vllm_at_a_time():
        POD_PHASES.append(("waited for the machine-wide vLLM lock", time.monotonic() - waited))
        start = time.monotonic()
        with pod.running():
            ready = _wait_for(pod.ready, READY_TIMEOUT, "pod Ready", pod)
            POD_PHASES.append(("pod started -> Ready (startup probe, then readiness)", ready))
            yield HelmPod(pod, manifests, api_key)
        POD_PHASES.append(("the pod run, start to removal", time.monotonic() - start))
        POD_EVENTS.extend(f"{e.seconds:6.1f} s {e.text}" for e in pod.events)


def test_flagged_chat_through_the_service_matches_transformers(
    helm_pod: HelmPod, reference: Reference
) -> None:
    text = "Summarize this text in one word: A yellow bicycle beside a stone wall."
    assert_matches(helm_pod.flagged_vector(text), expected_vector(reference, text))


def test_layers_set_by_the_chart_match_transformers(
    helm_pod: HelmPod, reference: Reference
) -> None:
    layers = [int(layer) for layer in _values()["hiddenStateLayers"].split(",")]
    text = "A layer through the chart."
    with helm_pod.client() as client:
        response = client.chat.completions.create(
            model=helm_pod.model,
            messages=[{"role": "user", "content": text}],
            max_completion_tokens=1,
            extra_body={
                **FLAG,
                "kv_transfer_params": {
                    "return_last_hidden_state": True,
                    "last_hidden_state_layers": layers,
                },
            },
        )
    by_layer = response.model_dump()["kv_transfer_params"]["last_hidden_states_by_layer"]
    ids = reference.chat_token_ids([{"role": "user", "content": text}], enable_thinking=False)
    assert set(by_layer) == {str(layer) for layer in layers}
    for label, vector in by_layer.items():
        assert_matches(vector, reference.layer_vector(ids, int(label), "last"))


def _post_chat(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    body = {
        "model": _values()["servedModelName"],
        "messages": [{"role": "user", "content": "Is the key required?"}],
        "max_completion_tokens": 1,
        **FLAG,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_the_service_requires_the_generated_key(helm_pod: HelmPod, reference: Reference) -> None:
    """proxy.apiKey is on by default: through the Service's port, no key or a wrong one is a 401
    (the proxy's OpenAI-shaped error), the Secret's key gets a vector."""
    url = helm_pod.pod.service_url
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        status, reply = _post_chat(url, headers)
        assert status == 401, (headers, reply)
        assert "error" in reply and "last_hidden_state" not in json.dumps(reply)
    status, reply = _post_chat(url, {"Authorization": f"Bearer {helm_pod.api_key}"})
    assert status == 200, reply
    assert len(reply["kv_transfer_params"]["last_hidden_state"]) == reference.hidden_size


def test_pre_stop_commands_exist_in_the_images(helm_pod: HelmPod) -> None:
    """Both containers' preStop (`sleep N`) runs in its image (python-slim and vLLM's): the same
    command with 0 seconds. (The simulated node does not run preStop hooks on removal.)"""
    for name in ("vllm", "proxy"):
        spec = next(c for c in helm_pod.pod.spec["containers"] if c["name"] == name)
        command = spec["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and int(command[1]) > 0, command
        helm_pod.pod.exec(name, [command[0], "0"])


def test_helm_test_pod_passes(helm_pod: HelmPod, reference: Reference) -> None:
    """`helm test`: the chart's test pod, its command and env as rendered, against the Service's
    name and port."""
    assert _values()["tests"]["hiddenSize"] == reference.hidden_size
    start = time.monotonic()
    code, output = run_to_completion(helm_pod.pod, helm_pod.test_pod, timeout=300)
    POD_PHASES.append(("helm test pod", time.monotonic() - start))
    assert code == 0, output
    assert output.startswith(f"OK: {reference.hidden_size} floats, 401 without the key"), output


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict((key, value.strip()) for key, _, value in (line.partition(":") for line in lines))


def _main_pid(pod: Pod, container: str) -> int:
    done = docker_host.run(
        ["docker", "inspect", "--format", "{{.State.Pid}}", pod.container_id(container)],
        timeout=60,
    )
    return int(done.stdout)


def test_containers_run_as_the_security_context_says(helm_pod: HelmPod) -> None:
    """The proxy's main process as the kernel sees it: 10001:10001, with the pod's fsGroup as a
    supplementary group and no capabilities; a read-only root. vLLM: root, plus the fsGroup."""
    proxy = _status(_main_pid(helm_pod.pod, "proxy"))
    assert {int(x) for x in proxy["Uid"].split()} == {PROXY_UID}
    assert {int(x) for x in proxy["Gid"].split()} == {PROXY_GID}
    assert str(PROXY_GID) in proxy["Groups"].split()
    assert int(proxy["CapEff"], 16) == 0
    assert proxy["NoNewPrivs"] == "1"
    touch = "import pathlib; pathlib.Path('/root-is-read-only').touch()"
    written = docker_host.run(
        ["docker", "exec", helm_pod.pod.container_id("proxy"), "python3", "-c", touch],
        timeout=60,
        check=False,
    )
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    vllm = _status(_main_pid(helm_pod.pod, "vllm"))
    assert {int(x) for x in vllm["Uid"].split()} == {0}
    assert str(PROXY_GID) in vllm["Groups"].split()


def test_only_the_proxy_is_reachable_from_outside_the_pod(helm_pod: HelmPod) -> None:
    """From the node, the pod's IP answers on the proxy's port; vLLM's (127.0.0.1 in the pod)
    refuses."""
    pod = helm_pod.pod
    vllm_port = int(_values().get("vllm", {}).get("port", 8001))
    with socket.create_connection((pod.pod_ip, pod.target_port()), timeout=10):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((pod.pod_ip, vllm_port), timeout=10).close()


def test_ring_has_the_documented_permissions(helm_pod: HelmPod) -> None:
    """docs/deploy.md: the ring directory drwxrws--- root:10001 once vLLM's hook has it, its
    files -rw-r----- root:10001."""
    found: dict[str, list[Any]] = json.loads(
        helm_pod.pod.exec("vllm", ["python3", "-c", RING_STAT])
    )
    assert found.pop(RING_DIR) == [RING_DIR_MODE, 0, PROXY_GID, True]
    assert found, "no ring-*.bin file in the ring volume"
    for path, described in found.items():
        assert described == [RING_FILE_MODE, 0, PROXY_GID, False], path


def test_killed_engine_makes_the_pod_unready_until_vllm_is_restarted(
    helm_pod: HelmPod, reference: Reference
) -> None:
    """SIGKILL to vLLM's engine (as the OOM killer would): the proxy's readiness probe fails
    failureThreshold times and the pod leaves Ready; vLLM's API server exits, so the node
    restarts the container (restartPolicy Always; had it hung instead, the liveness probe would
    have condemned it); the startup probe passes again, the pod is Ready, vectors are back, and
    the proxy container was never restarted."""
    pod = helm_pod.pod
    assert pod.ready()
    killed = pod.exec("vllm", ["python3", "-c", KILL_ENGINE]).split()
    assert len(killed) == 1, f"expected one engine process, killed {killed}"
    start = time.monotonic()
    # The proxy's own readiness probe must fail failureThreshold times: the pod's Ready alone
    # would also follow vLLM's container being replaced.
    _wait_for(lambda: not pod.container_ready("proxy"), 120, "proxy not Ready", pod)
    unready = time.monotonic() - start
    assert not pod.ready()
    _wait_for(lambda: pod.restarts("vllm") >= 1, 300, "vLLM restarted", pod)
    restarted = time.monotonic() - start
    _wait_for(pod.ready, READY_TIMEOUT, "pod Ready again", pod)
    ready = time.monotonic() - start
    POD_PHASES.append(("engine killed -> the proxy's readiness probe failed (not Ready)", unready))
    POD_PHASES.append(("engine killed -> vLLM container restarted", restarted))
    POD_PHASES.append(("engine killed -> pod Ready again", ready))
    text = "Is the sky blue?"
    assert_matches(helm_pod.flagged_vector(text), expected_vector(reference, text))
    assert pod.restarts("proxy") == 0
