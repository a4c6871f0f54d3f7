"""The Helm chart, offline: lint, render, Kubernetes 1.30 schemas, and what the pod looks like."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml

from tests.deploy.commands import CHART_DIR, REPO, chart_commands, chart_manifests
from tests.deploy.deploy_helpers import (
    VALUES_FILES,
    argv_of,
    container,
    env_of,
    flag_value,
    objects_of,
    only,
    pod_spec,
)

KUBE_VERSION = "1.30"
#: Custom resources kubernetes-validate has no schema for; checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
SETS = list(VALUES_FILES)


def ci_values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return chart_manifests(values=values, release="rel", namespace="ns")


# ---------------------------------------------------------------------------------------------
# helm lint / helm template / Kubernetes schemas


def test_ci_values_files_exist() -> None:
    assert {"default", "cpu", "gpu", "tp2"} <= set(VALUES_FILES)


@pytest.mark.parametrize("name", SETS)
def test_helm_lint_strict(name: str) -> None:
    report = helm_python.lint(
        str(CHART_DIR), ci_values(name), strict=True, kube_version=f"v{KUBE_VERSION}.0"
    )
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # strict: warnings count as failures too (severity 2 = warning, 3 = error; 1 is info).
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", SETS)
def test_rendered_objects_pass_kubernetes_schemas(rendered: dict[str, Any], name: str) -> None:
    objects = objects_of(rendered[name])
    kinds = {doc["kind"] for doc in objects}
    assert {"Deployment", "Service", "Pod"} <= kinds
    for doc in objects:
        if doc["kind"] in CRD_KINDS:
            continue
        assert kubernetes_validate.validate(doc, KUBE_VERSION, strict=True) == KUBE_VERSION


def test_kubernetes_validate_is_strict(rendered: dict[str, Any]) -> None:
    """The schema check above can fail: an unknown field in the pod spec is rejected."""
    deployment = json.loads(json.dumps(only(objects_of(rendered["default"]), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][1]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_names_follow_release(rendered: dict[str, Any]) -> None:
    for doc in objects_of(rendered["default"]):
        assert doc["metadata"]["name"].startswith("rel-vllm-hidden-state")
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"


# ---------------------------------------------------------------------------------------------
# The pod: two containers, shared memory, loopback vLLM


@pytest.mark.parametrize("name", SETS)
def test_both_containers_share_the_memory_ring_volume(rendered: dict[str, Any], name: str) -> None:
    spec = pod_spec(rendered[name])
    volumes = {v["name"]: v for v in spec["volumes"]}
    vllm, proxy = container(rendered[name], "vllm"), container(rendered[name], "proxy")
    vllm_mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    proxy_mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    shared = set(vllm_mounts) & set(proxy_mounts)
    assert shared == {"ring"}
    assert volumes["ring"]["emptyDir"]["medium"] == "Memory"
    mount = vllm_mounts["ring"]
    assert proxy_mounts["ring"] == mount
    ring_dir = env_of(vllm)["HIDDEN_STATE_PROXY_RING_DIR"]
    assert env_of(proxy)["HIDDEN_STATE_PROXY_RING_DIR"] == ring_dir
    assert flag_value(argv_of(proxy), "--ring-dir") == ring_dir
    # The volume is the ring directory itself: it exists before vLLM starts, so the hook keeps its
    # fsGroup ownership and setgid bit (it chmods only a directory it creates).
    assert ring_dir == mount
    # vLLM's own /dev/shm: a second memory emptyDir, not the ring, not in the proxy.
    assert vllm_mounts["dshm"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert "/dev/shm" not in proxy_mounts.values()
    assert not ring_dir.startswith("/dev/shm")


@pytest.mark.parametrize("name", SETS)
def test_ring_is_readable_across_users(rendered: dict[str, Any], name: str) -> None:
    """The proxy (uid 10001) reads what vLLM (root) writes: shared fsGroup + group-readable ring."""
    spec = pod_spec(rendered[name])
    proxy = container(rendered[name], "proxy")
    vllm = container(rendered[name], "vllm")
    assert spec["securityContext"]["fsGroup"] == proxy["securityContext"]["runAsGroup"]
    for c in (vllm, proxy):
        mode = int(env_of(c)["HIDDEN_STATE_PROXY_RING_DIR_MODE"], 8)
        assert mode & 0o050 == 0o050, oct(mode)  # group r-x
        assert mode & 0o007 == 0, oct(mode)  # nothing for others


@pytest.mark.parametrize("name", SETS)
def test_proxy_is_non_root_with_read_only_root(rendered: dict[str, Any], name: str) -> None:
    proxy = container(rendered[name], "proxy")
    security = proxy["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert pod_spec(rendered[name])["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", SETS)
def test_vllm_binds_loopback_and_is_not_exposed(rendered: dict[str, Any], name: str) -> None:
    vllm, proxy = container(rendered[name], "vllm"), container(rendered[name], "proxy")
    argv = argv_of(vllm)
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert "ports" not in vllm
    port = flag_value(argv, "--port")
    assert flag_value(argv_of(proxy), "--upstream") == f"http://127.0.0.1:{port}"
    assert flag_value(argv_of(proxy), "--host") == "0.0.0.0"


@pytest.mark.parametrize("name", SETS)
def test_service_targets_the_proxy(rendered: dict[str, Any], name: str) -> None:
    objects = objects_of(rendered[name])
    service = only(objects, "Service")
    deployment = only(objects, "Deployment")
    proxy = container(rendered[name], "proxy")
    proxy_ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert proxy_ports["http"] == int(flag_value(argv_of(proxy), "--port") or 0)
    selector = service["spec"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"] == selector


@pytest.mark.parametrize("name", SETS)
def test_probes(rendered: dict[str, Any], name: str) -> None:
    vllm, proxy = container(rendered[name], "vllm"), container(rendered[name], "proxy")
    port = flag_value(argv_of(vllm), "--port")
    for probe in ("startupProbe", "livenessProbe"):
        command = vllm[probe]["exec"]["command"]
        assert command[:2] == ["python3", "-c"]
        assert f"'http://127.0.0.1:{port}/health'" in command[2]
    startup = vllm["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60  # large models
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in proxy["livenessProbe"]  # /health follows vLLM: not for liveness


def test_vllm_probe_command_runs(tmp_path: Path) -> None:
    """The exec probe's Python one-liner fails against a dead port (so it can fail)."""
    manifests = render({"vllm": {"port": 1}, "proxy": {"port": 8000}})
    command = container(manifests, "vllm")["livenessProbe"]["exec"]["command"]
    result = subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=30)
    assert result.returncode != 0


@pytest.mark.parametrize("name", SETS)
def test_gpu_resources_only_with_gpu_values(rendered: dict[str, Any], name: str) -> None:
    spec = pod_spec(rendered[name])
    vllm = container(rendered[name], "vllm")
    gpus = vllm.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    tp = int(flag_value(argv_of(vllm), "--tensor-parallel-size") or 0)
    text = json.dumps(spec)
    if name == "cpu":
        assert "nvidia.com/gpu" not in text
        assert vllm["image"].endswith("-cpu")
        assert flag_value(argv_of(vllm), "--gpu-memory-utilization") is None
    else:
        assert gpus is not None and int(gpus) >= tp
        assert vllm["image"].endswith("-gpu")
        assert "nvidia.com/gpu" not in json.dumps(container(rendered[name], "proxy"))
    if name == "tp2":
        assert tp == 2 and int(gpus) == 2


def test_model_arguments(rendered: dict[str, Any]) -> None:
    argv = argv_of(container(rendered["tp2"], "vllm"))
    assert flag_value(argv, "--model") == "Qwen/Qwen3-8B"
    assert flag_value(argv, "--max-model-len") == "32768"
    assert flag_value(argv, "--gpu-memory-utilization") == "0.92"
    assert argv[-3:] == ["--enable-prefix-caching", "--max-num-seqs", "128"]  # extraArgs last
    assert flag_value(argv_of(container(rendered["default"], "vllm")), "--max-model-len") is None
    gpu = argv_of(container(rendered["gpu"], "vllm"))
    assert flag_value(gpu, "--served-model-name") == "qwen3-0.6b"
    assert (
        flag_value(argv_of(container(rendered["default"], "vllm")), "--served-model-name") is None
    )
    big = argv_of(container(render({"maxModelLen": 1048576}), "vllm"))
    assert flag_value(big, "--max-model-len") == "1048576"  # not 1.048576e+06


def test_embedding_template_and_vector_timeout_only_when_set(rendered: dict[str, Any]) -> None:
    default_proxy = container(rendered["default"], "proxy")
    assert "HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE" not in env_of(default_proxy)
    assert flag_value(argv_of(default_proxy), "--vector-timeout") is None
    gpu_proxy = container(rendered["gpu"], "proxy")
    assert env_of(gpu_proxy)["HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE"] == "query: {text}"
    assert flag_value(argv_of(gpu_proxy), "--vector-timeout") == "10"
    assert flag_value(argv_of(container(rendered["cpu"], "proxy")), "--vector-timeout") == "30"
    for name in SETS:
        assert "HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE" not in env_of(
            container(rendered[name], "vllm")
        )
    assert "HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE" not in env_of(
        container(render({"embeddingTemplate": ""}), "proxy")
    )


def test_hf_token_secret(rendered: dict[str, Any]) -> None:
    assert "HF_TOKEN" not in env_of(container(rendered["default"], "vllm"))
    assert "Secret" not in {d["kind"] for d in objects_of(rendered["default"])}
    created = only(objects_of(rendered["gpu"]), "Secret")
    ref = env_of(container(rendered["gpu"], "vllm"))["HF_TOKEN"]["secretKeyRef"]
    assert ref["name"] == created["metadata"]["name"]
    assert base64.b64decode(created["data"][ref["key"]]).decode() == "hf_example_not_a_real_token"
    assert "Secret" not in {d["kind"] for d in objects_of(rendered["tp2"])}
    existing = env_of(container(rendered["tp2"], "vllm"))["HF_TOKEN"]["secretKeyRef"]
    assert existing == {"name": "hf-token", "key": "token"}


def test_model_cache(rendered: dict[str, Any]) -> None:
    def cache(name: str) -> dict[str, Any]:
        volumes = {v["name"]: v for v in pod_spec(rendered[name])["volumes"]}
        found: dict[str, Any] = volumes["model-cache"]
        return found

    assert cache("default")["emptyDir"] == {}
    assert cache("cpu")["emptyDir"] == {"sizeLimit": "20Gi"}
    pvc = only(objects_of(rendered["gpu"]), "PersistentVolumeClaim")
    assert cache("gpu")["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert cache("tp2")["persistentVolumeClaim"]["claimName"] == "models"
    vllm = container(rendered["default"], "vllm")
    mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    assert env_of(vllm)["HF_HOME"] == mounts["model-cache"]


def test_autoscaling_pdb_and_service_monitor(rendered: dict[str, Any]) -> None:
    default_kinds = {d["kind"] for d in objects_of(rendered["default"])}
    assert not default_kinds & {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor"}
    assert only(objects_of(rendered["default"]), "Deployment")["spec"]["replicas"] == 1

    objects = objects_of(rendered["gpu"])
    deployment = only(objects, "Deployment")
    hpa = only(objects, "HorizontalPodAutoscaler")
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["type"] == "Pods"
    pdb = only(objects, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert only(objects_of(rendered["tp2"]), "PodDisruptionBudget")["spec"] == {
        "maxUnavailable": 1,
        "selector": pdb["spec"]["selector"],
    }

    monitor = only(objects, "ServiceMonitor")
    service = only(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "http"  # the proxy's /metrics
    assert endpoint["path"] == "/metrics"


# ---------------------------------------------------------------------------------------------
# values.schema.json and the template's own checks

BAD_VALUES = [
    pytest.param({"replicaCout": 2}, "replicaCout", id="misspelt-top-level-key"),
    pytest.param({"image": {"vllm": {"tga": "x"}}}, "tga", id="misspelt-nested-key"),
    pytest.param({"modelCache": {"tpye": "pvc"}}, "tpye", id="misspelt-model-cache-key"),
    pytest.param({"replicaCount": "2"}, "replicaCount", id="string-for-integer"),
    pytest.param({"tensorParallelSize": 1.5}, "tensorParallelSize", id="float-for-integer"),
    pytest.param({"extraArgs": "--enforce-eager"}, "extraArgs", id="string-for-list"),
    pytest.param({"autoscaling": {"enabled": "yes"}}, "enabled", id="string-for-boolean"),
    pytest.param({"gpuMemoryUtilization": 1.5}, "gpuMemoryUtilization", id="out-of-range"),
    pytest.param({"modelCache": {"type": "hostPath"}}, "type", id="not-in-enum"),
    pytest.param({"ringDir": "ring"}, "ringDir", id="relative-ring-dir"),
    pytest.param({"embeddingTemplate": "query:"}, "embeddingTemplate", id="template-no-text"),
]


@pytest.mark.parametrize(("values", "key"), BAD_VALUES)
def test_schema_rejects_bad_values(values: dict[str, Any], key: str) -> None:
    with (
        helm_python.Chart.load(str(CHART_DIR)) as chart,
        pytest.raises(helm_python.HelmValuesError, match=key),
    ):
        chart.render(values, name="rel", namespace="ns")
    report = helm_python.lint(str(CHART_DIR), values, strict=True)
    assert any(key in error for error in report["errors"]), report


TEMPLATE_CHECKS = [
    pytest.param({"tensorParallelSize": 2}, "needs at least 2 GPUs", id="tp-above-gpus"),
    pytest.param({"ringDir": "/dev/shm/vllm"}, "outside /dev/shm", id="ring-in-dev-shm"),
    pytest.param({"ringDir": "/dev/shm"}, "outside /dev/shm", id="ring-is-dev-shm"),
    pytest.param({"vllm": {"port": 8000}}, "must differ", id="same-ports"),
    pytest.param(
        {"vllm": {"env": [{"name": "VLLM_PLUGINS", "value": "other"}]}},
        "hidden_state_hook",
        id="vllm-plugins-without-hook",
    ),
    pytest.param({"autoscaling": {"enabled": True}}, "autoscaling", id="hpa-without-metric"),
    pytest.param({"modelCache": {"type": "existingClaim"}}, "existingClaim", id="claim-missing"),
]


@pytest.mark.parametrize(("values", "message"), TEMPLATE_CHECKS)
def test_template_rejects_inconsistent_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(values)


def test_vllm_plugins_including_the_hook_is_accepted() -> None:
    env = [{"name": "VLLM_PLUGINS", "value": "other,hidden_state_hook"}]
    assert (
        env_of(container(render({"vllm": {"env": env}}), "vllm"))["VLLM_PLUGINS"] == env[0]["value"]
    )


def test_schema_is_draft7_and_accepts_defaults() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    for name in SETS:
        with helm_python.Chart.load(str(CHART_DIR)) as chart:
            chart.validate_schema(ci_values(name))


#: Kubernetes-native objects whose optional fields need no chart default.
NATIVE = {"global", "resources"}


def _schema_drift(schema: dict[str, Any], values: Any, path: str) -> list[str]:
    """Keys the schema declares but values.yaml lacks, in closed (additionalProperties: false)
    objects: every option must have a documented default."""
    drift: list[str] = []
    if schema.get("additionalProperties") is False and isinstance(values, dict):
        for key, sub in schema.get("properties", {}).items():
            if f"{path}{key}" in NATIVE:
                continue
            if key not in values:
                drift.append(f"{path}{key}")
            else:
                drift += _schema_drift(sub, values[key], f"{path}{key}.")
    return drift


def test_schema_and_values_cover_each_other() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert _schema_drift(schema, values, "") == []


def test_every_value_is_commented() -> None:
    """helm-docs style: each option has a `# --` comment right above it (a commented parent
    documents its whole default block)."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    key_line = re.compile(r"^(\s*)([A-Za-z][\w.-]*):(.*)$")
    missing: list[str] = []
    documented_indent: int | None = None
    for i, line in enumerate(lines):
        match = key_line.match(line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        if documented_indent is not None and indent > documented_indent:
            continue
        documented_indent = None
        comments: list[str] = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            comments.append(lines[j].strip())
            j -= 1
        has_doc = any(c.startswith("# --") for c in comments)
        following = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
        is_leaf = rest != "" or following.startswith("- ")
        if has_doc and not is_leaf:
            documented_indent = indent
        elif is_leaf and not has_doc:
            missing.append(key)
    assert missing == []


def test_versions_match_the_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert chart["appVersion"] == project["version"]
    assert values["image"]["proxy"]["tag"] == project["version"]
    assert values["image"]["vllm"]["tag"] == f"{project['version']}-gpu"
    assert ci_values("cpu")["image"]["vllm"]["tag"] == f"{project['version']}-cpu"


def test_chart_files() -> None:
    for name in ("NOTES.txt", "_helpers.tpl"):
        assert (CHART_DIR / "templates" / name).is_file()
    helpers = (CHART_DIR / "templates" / "_helpers.tpl").read_text()
    for define in ("name", "fullname", "chart", "labels", "selectorLabels", "serviceAccountName"):
        assert f'define "vllm-hidden-state.{define}"' in helpers
    with helm_python.Chart.load(str(CHART_DIR)) as chart:
        rendered = chart.render({}, name="rel", namespace="ns")
    notes = rendered["vllm-hidden-state/templates/NOTES.txt"]
    assert "port-forward service/rel-vllm-hidden-state" in notes
    assert '"return_last_hidden_state": true' in notes
    assert "helm test rel" in notes


# ---------------------------------------------------------------------------------------------
# helm test


class _FakeProxy(BaseHTTPRequestHandler):
    reply: ClassVar[Any] = None
    seen: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "body": body})
        data = json.dumps(type(self).reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_proxy() -> Any:
    server = HTTPServer(("127.0.0.1", 0), _FakeProxy)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    _FakeProxy.seen = []
    yield server
    server.shutdown()
    server.server_close()


def test_helm_test_pod_is_a_test_hook(rendered: dict[str, Any]) -> None:
    pods = [d for d in objects_of(rendered["default"]) if d["kind"] == "Pod"]
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    env = env_of(pod["spec"]["containers"][0])
    service = only(objects_of(rendered["default"]), "Service")
    assert (
        env["PROXY_URL"]
        == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    )
    assert env["EXPECTED_LENGTH"] == "1024"
    assert (
        env_of(
            next(d for d in objects_of(rendered["gpu"]) if d["kind"] == "Pod")["spec"][
                "containers"
            ][0]
        )["MODEL"]
        == "qwen3-0.6b"
    )


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        pytest.param({"kv_transfer_params": {"last_hidden_state": [0.5] * 8}}, True, id="right"),
        pytest.param({"kv_transfer_params": {"last_hidden_state": [0.5] * 7}}, False, id="short"),
        pytest.param({"choices": []}, False, id="no-vector"),
        pytest.param({"kv_transfer_params": {"last_hidden_state": ["x"] * 8}}, False, id="strings"),
    ],
)
def test_helm_test_script(fake_proxy: HTTPServer, reply: dict[str, Any], ok: bool) -> None:
    _FakeProxy.reply = reply
    argv, env = chart_commands(values={"tests": {"hiddenSize": 8}})["test"]
    env["PROXY_URL"] = f"http://127.0.0.1:{fake_proxy.server_address[1]}"
    assert argv[:2] == ["python3", "-c"]
    result = subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode == 0) is ok, result.stdout + result.stderr
    (request,) = _FakeProxy.seen
    assert request["path"] == "/v1/chat/completions"
    assert request["body"]["kv_transfer_params"] == {"return_last_hidden_state": True}
    assert request["body"]["model"] == "Qwen/Qwen3-0.6B"
