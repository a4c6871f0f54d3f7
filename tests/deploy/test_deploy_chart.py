"""The Helm chart, offline: lint, render, Kubernetes 1.30 schemas, and what the pod looks like."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
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

from tests.compose.pod import quantity_bytes
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
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

KUBE_VERSION = "1.30"
MIB = 1 << 20
#: Custom resources kubernetes-validate has no schema for; their shape is checked by hand below.
CRD_KINDS = {"ServiceMonitor", "HTTPRoute"}
SETS = list(VALUES_FILES)


def ci_values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return chart_manifests(values=values, release="rel", namespace="ns")


# ---------------------------------------------------------------------------------------------
# helm lint / helm template / Kubernetes schemas


def test_ci_values_files_exist() -> None:
    assert {"default", "cpu", "gpu", "tp2", "all-fields"} <= set(VALUES_FILES)


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


#: docs/deploy.md, "The proxy's memory": idle, and what uvicorn buffers outside the budgets.
PROXY_IDLE = 76 * MIB
UVICORN_BUFFERS = 128 * MIB


@pytest.mark.parametrize("name", SETS)
def test_the_proxys_memory_limit_fits_its_budgets(rendered: dict[str, Any], name: str) -> None:
    """The proxy's default budgets (or the ones the values pass it) fit its container's limit,
    so that a full budget is a 503, not an OOM kill."""
    proxy = container(rendered[name], "proxy")
    limit = quantity_bytes(proxy["resources"]["limits"]["memory"])
    argv = argv_of(proxy)
    defaults = ProxySettings(upstream_url="http://x")
    vectors = int(flag_value(argv, "--vectors-budget") or defaults.vectors_budget_bytes)
    bodies = int(flag_value(argv, "--body-budget") or defaults.body_budget_bytes)
    assert flag_value(argv, "--workers") is None  # each worker would have its own budgets
    assert PROXY_IDLE + vectors + bodies + UVICORN_BUFFERS <= limit


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


def secrets(manifests: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """name -> Secret, of the rendered objects."""
    return {d["metadata"]["name"]: d for d in objects_of(manifests) if d["kind"] == "Secret"}


def test_hf_token_secret(rendered: dict[str, Any]) -> None:
    assert "HF_TOKEN" not in env_of(container(rendered["default"], "vllm"))
    assert set(secrets(rendered["default"])) == {"rel-vllm-hidden-state-api-key"}
    ref = env_of(container(rendered["gpu"], "vllm"))["HF_TOKEN"]["secretKeyRef"]
    created = secrets(rendered["gpu"])[ref["name"]]
    assert base64.b64decode(created["data"][ref["key"]]).decode() == "hf_example_not_a_real_token"
    assert set(secrets(rendered["tp2"])) == {"rel-vllm-hidden-state-api-key"}
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
    # chart 0.2.0's fields
    pytest.param({"vllm": {"resources": "big"}}, "resources", id="string-for-resources"),
    pytest.param(
        {"vllm": {"livenessProbe": {"periodSecond": 5}}}, "periodSecond", id="misspelt-probe-field"
    ),
    pytest.param(
        {"proxy": {"readinessProbe": {"initialDelaySeconds": "5"}}},
        "initialDelaySeconds",
        id="string-for-probe-delay",
    ),
    pytest.param({"proxy": {"apiKey": {"enabled": "no"}}}, "enabled", id="string-for-key-switch"),
    pytest.param({"proxy": {"apiKey": {"secret": "k"}}}, "secret", id="misspelt-api-key-field"),
    pytest.param({"proxy": {"drainTimeout": -1}}, "drainTimeout", id="negative-drain"),
    pytest.param({"preStopSleepSeconds": 2.5}, "preStopSleepSeconds", id="float-pre-stop"),
    pytest.param(
        {"ingress": {"hosts": [{"host": "a", "paths": [{"path": "/", "pathType": "Any"}]}]}},
        "pathType",
        id="ingress-path-type",
    ),
    pytest.param({"httpRoute": {"enabeld": True}}, "enabeld", id="misspelt-route-key"),
    pytest.param({"serviceMonitor": {"honorLabels": "true"}}, "honorLabels", id="string-honor"),
    pytest.param({"extraVolumes": {"name": "x"}}, "extraVolumes", id="map-for-volume-list"),
    pytest.param({"vllm": {"envFrom": [{"secret": {}}]}}, "secret", id="envfrom-unknown-source"),
    pytest.param({"topologySpreadConstraints": [{"maxSkew": 1}]}, "topologyKey", id="spread"),
    # the keys chart 0.2.0 moved: refused, naming their new place
    pytest.param(
        {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "moved to vllm.resources",
        id="moved-resources",
    ),
    pytest.param(
        {"securityContext": {"runAsUser": 10001}},
        "moved to proxy.securityContext",
        id="moved-security-context",
    ),
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
    pytest.param(
        {"serviceMonitor": {"enabled": True, "scrapeTimeout": "2s"}},
        "proxy.metricsUpstreamTimeout 2 must be below serviceMonitor.scrapeTimeout 2s",
        id="metrics-timeout-not-below-scrape-timeout",
    ),
    pytest.param(
        {"serviceMonitor": {"enabled": True}, "proxy": {"metricsUpstreamTimeout": 12}},
        "must be below serviceMonitor.scrapeTimeout 10s",
        id="metrics-timeout-above-scrape-timeout",
    ),
    pytest.param(
        {"serviceMonitor": {"enabled": True, "scrapeTimeout": "1500ms"}},
        "must be below serviceMonitor.scrapeTimeout 1500ms",
        id="metrics-timeout-above-scrape-timeout-in-ms",
    ),
    pytest.param(
        {"terminationGracePeriodSeconds": 30},
        "terminationGracePeriodSeconds 30 must exceed preStopSleepSeconds 5 + "
        "proxy.drainTimeout 25 = 30",
        id="grace-not-above-prestop-and-drain",
    ),
    pytest.param(
        {"preStopSleepSeconds": 0, "proxy": {"drainTimeout": 70}},
        "must exceed preStopSleepSeconds 0 + proxy.drainTimeout 70 = 70",
        id="drain-above-grace",
    ),
    pytest.param(
        {"vllm": {"livenessProbe": {"tcpSocket": {"port": 8001}, "exec": {"command": ["true"]}}}},
        "vllm.livenessProbe has 2 handlers",
        id="probe-with-two-handlers",
    ),
    pytest.param(
        {"proxy": {"env": [{"name": "HIDDEN_STATE_PROXY_API_KEY", "value": "k"}]}},
        "proxy.apiKey.existingSecret",
        id="key-in-env-and-secret",
    ),
    pytest.param(
        {"proxy": {"apiKey": {"enabled": False}, "protectMetrics": True}},
        "proxy.protectMetrics needs proxy.apiKey.enabled",
        id="protect-metrics-without-key",
    ),
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


#: Kubernetes-native objects whose optional fields need no chart default, and the keys moved in
#: chart 0.2.0 (declared only so that the schema names their new place).
NATIVE = {"global", "resources", "securityContext"}


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
        if has_doc:  # documents its whole value, a list of maps included
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
    # The generated key, and how to read it.
    assert (
        "kubectl --namespace ns get secret rel-vllm-hidden-state-api-key "
        "-o jsonpath='{.data.api-key}' | base64 -d" in notes
    )
    assert '-H "Authorization: Bearer $API_KEY"' in notes


# ---------------------------------------------------------------------------------------------
# chart 0.2.0: ci/all-fields-values.yaml, the API key, shutdown, probes, routes


def test_every_field_of_all_fields_lands_where_it_belongs(rendered: dict[str, Any]) -> None:
    values = ci_values("all-fields")
    manifests = rendered["all-fields"]
    spec = pod_spec(manifests)
    vllm, proxy = container(manifests, "vllm"), container(manifests, "proxy")
    for name, c in (("vllm", vllm), ("proxy", proxy)):
        assert c["resources"] == values[name]["resources"], name
        # Helm merges a map with the chart's default (the proxy's keeps its seccompProfile).
        assert values[name]["securityContext"].items() <= c["securityContext"].items(), name
        assert c["envFrom"] == values[name]["envFrom"], name
        for mount in values[name]["extraVolumeMounts"]:
            assert mount in c["volumeMounts"], name
    assert spec["securityContext"] == values["podSecurityContext"]
    volumes = [v for v in spec["volumes"] if v["name"] in {"chat-templates", "ca-bundle"}]
    assert volumes == values["extraVolumes"]
    for key in ("runtimeClassName", "priorityClassName", "topologySpreadConstraints"):
        assert spec[key] == values[key], key
    for key in ("nodeSelector", "tolerations", "affinity", "terminationGracePeriodSeconds"):
        assert spec[key] == values[key], key
    # probes: the values' fields as given, the chart's handler where they name none
    assert vllm["startupProbe"]["initialDelaySeconds"] == 30
    (python, flag, check) = vllm["readinessProbe"]["exec"]["command"]
    assert (python, flag) == ("python3", "-c") and "'http://127.0.0.1:8001/health'" in check
    assert "timeout=5)" in check  # the probe's own timeoutSeconds
    # Helm merges a probe with the chart's default: the given fields win, the rest stay.
    assert values["proxy"]["livenessProbe"].items() <= proxy["livenessProbe"].items()
    assert "httpGet" not in proxy["livenessProbe"]
    assert (
        proxy["startupProbe"] == {"tcpSocket": {"port": "http"}} | values["proxy"]["startupProbe"]
    )
    assert proxy["readinessProbe"]["initialDelaySeconds"] == 2
    # the proxy's options
    argv = argv_of(proxy)
    assert flag_value(argv, "--drain-timeout") == "40"
    assert flag_value(argv, "--metrics-upstream-timeout") == "5"
    assert "--protect-metrics" in argv and "--allow-unauthenticated" not in argv


def test_defaults_have_no_new_optional_objects(rendered: dict[str, Any]) -> None:
    """Ingress, HTTPRoute, ServiceMonitor, extra volumes and the scheduling fields are off by
    default; the probes are those of chart 0.1.0."""
    kinds = {d["kind"] for d in objects_of(rendered["default"])}
    assert not kinds & {"Ingress", "HTTPRoute", "ServiceMonitor"}
    spec = pod_spec(rendered["default"])
    assert not {"runtimeClassName", "priorityClassName", "topologySpreadConstraints"} & set(spec)
    assert {v["name"] for v in spec["volumes"]} == {"ring", "dshm", "proxy-tmp", "model-cache"}
    vllm, proxy = container(rendered["default"], "vllm"), container(rendered["default"], "proxy")
    assert "readinessProbe" not in vllm and "startupProbe" not in proxy
    assert "envFrom" not in vllm and "envFrom" not in proxy
    timing = {k: v for k, v in vllm["startupProbe"].items() if k != "exec"}
    assert timing == {"periodSeconds": 10, "failureThreshold": 360, "timeoutSeconds": 5}
    assert "timeout=5)" in vllm["startupProbe"]["exec"]["command"][2]
    assert "timeout=10)" in vllm["livenessProbe"]["exec"]["command"][2]
    assert proxy["livenessProbe"] == {
        "tcpSocket": {"port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 3,
        "timeoutSeconds": 3,
    }


def test_a_probe_can_change_its_type_or_be_removed() -> None:
    manifests = render(
        {
            "vllm": {"livenessProbe": None, "startupProbe": {"tcpSocket": {"port": 8001}}},
            "proxy": {"readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 7}},
        }
    )
    vllm, proxy = container(manifests, "vllm"), container(manifests, "proxy")
    assert "livenessProbe" not in vllm
    assert (
        vllm["startupProbe"]["tcpSocket"] == {"port": 8001} and "exec" not in vllm["startupProbe"]
    )
    assert proxy["readinessProbe"] == {
        "exec": {"command": ["true"]},
        "periodSeconds": 7,
        "failureThreshold": 3,
        "timeoutSeconds": 3,
    }


def test_api_key_secret_is_generated_by_default(rendered: dict[str, Any]) -> None:
    manifests = rendered["default"]
    created = secrets(manifests)["rel-vllm-hidden-state-api-key"]
    key = base64.b64decode(created["data"]["api-key"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", key)
    ref = {"secretKeyRef": {"name": "rel-vllm-hidden-state-api-key", "key": "api-key"}}
    assert env_of(container(manifests, "proxy"))["HIDDEN_STATE_PROXY_API_KEY"] == ref
    assert "HIDDEN_STATE_PROXY_API_KEY" not in env_of(container(manifests, "vllm"))
    argv = argv_of(container(manifests, "proxy"))
    assert "--allow-unauthenticated" not in argv and "--protect-metrics" not in argv
    assert not any(key in arg for arg in argv)  # never on the command line
    (test_pod,) = [d for d in objects_of(manifests) if d["kind"] == "Pod"]
    assert env_of(test_pod["spec"]["containers"][0])["API_KEY"] == ref
    # Offline (no cluster for `lookup`), each render draws a new key.
    again = secrets(render({}))["rel-vllm-hidden-state-api-key"]["data"]["api-key"]
    assert again != created["data"]["api-key"]


#: The one `lookup` of the chart: the generated key's Secret as the cluster holds it.
LOOKUP = 'lookup "v1" "Secret" .Release.Namespace (include "vllm-hidden-state.apiKeySecretName" .)'


def test_api_key_is_kept_across_upgrades(tmp_path: Path) -> None:
    """`lookup` finds the release's Secret on an upgrade: its key is reused, not redrawn. Offline
    it finds nothing, so the chart is copied with the lookup answering a Secret of the cluster."""
    chart = shutil.copytree(CHART_DIR, tmp_path / "chart")
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert text.count(LOOKUP) == 1
    kept = base64.b64encode(b"the-key-the-cluster-has").decode()
    helpers.write_text(text.replace(LOOKUP, f'dict "data" (dict "api-key" "{kept}")'))
    with helm_python.Chart.load(str(chart)) as loaded:
        rendered = loaded.render({}, name="rel", namespace="ns", is_upgrade=True)
    (secret,) = [
        doc
        for doc in yaml.safe_load_all(rendered["vllm-hidden-state/templates/api-key-secret.yaml"])
        if doc
    ]
    assert secret["data"]["api-key"] == kept


def test_api_key_from_an_existing_secret(rendered: dict[str, Any]) -> None:
    manifests = rendered["all-fields"]
    assert "llm-api-key" not in secrets(manifests)
    assert not any(name.endswith("-api-key") for name in secrets(manifests))
    ref = {"secretKeyRef": {"name": "llm-api-key", "key": "token"}}
    assert env_of(container(manifests, "proxy"))["HIDDEN_STATE_PROXY_API_KEY"] == ref
    (test_pod,) = [d for d in objects_of(manifests) if d["kind"] == "Pod"]
    assert env_of(test_pod["spec"]["containers"][0])["API_KEY"] == ref


def test_api_key_switched_off() -> None:
    manifests = render(
        {"proxy": {"apiKey": {"enabled": False}}, "serviceMonitor": {"enabled": True}}
    )
    assert secrets(manifests) == {}
    proxy = container(manifests, "proxy")
    assert "HIDDEN_STATE_PROXY_API_KEY" not in env_of(proxy)
    assert "--allow-unauthenticated" in argv_of(proxy)  # said, so the proxy does not warn
    (test_pod,) = [d for d in objects_of(manifests) if d["kind"] == "Pod"]
    assert "API_KEY" not in env_of(test_pod["spec"]["containers"][0])
    (endpoint,) = only(objects_of(manifests), "ServiceMonitor")["spec"]["endpoints"]
    assert "authorization" not in endpoint
    with helm_python.Chart.load(str(CHART_DIR)) as chart:
        notes = chart.render({"proxy": {"apiKey": {"enabled": False}}}, name="rel")[
            "vllm-hidden-state/templates/NOTES.txt"
        ]
    assert "anyone who reaches the Service may use the model" in notes
    assert "Authorization" not in notes


def test_service_monitor_authenticates_with_the_key(rendered: dict[str, Any]) -> None:
    values = ci_values("all-fields")["serviceMonitor"]
    for name, secret, key in (
        ("gpu", "rel-vllm-hidden-state-api-key", "api-key"),
        ("all-fields", "llm-api-key", "token"),
    ):
        monitor = only(objects_of(rendered[name]), "ServiceMonitor")
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["authorization"] == {
            "type": "Bearer",
            "credentials": {"name": secret, "key": key},
        }
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"] == values["relabelings"]
    assert endpoint["metricRelabelings"] == values["metricRelabelings"]
    # The shape the Prometheus Operator's CRD asks for (no offline schema for it).
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(endpoint) <= {
        "port",
        "path",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "authorization",
        "relabelings",
        "metricRelabelings",
    }
    for relabeling in endpoint["relabelings"] + endpoint["metricRelabelings"]:
        assert set(relabeling) <= {
            "sourceLabels",
            "separator",
            "targetLabel",
            "regex",
            "modulus",
            "replacement",
            "action",
        }


def test_ingress_and_http_route_reach_the_service(rendered: dict[str, Any]) -> None:
    objects = objects_of(rendered["all-fields"])
    service = only(objects, "Service")
    name, port = service["metadata"]["name"], service["spec"]["ports"][0]
    ingress = only(objects, "Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [
        {"hosts": ["llm.example.com"], "secretName": "llm-example-tls"}
    ]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert [p["path"] for p in rule["http"]["paths"]] == ["/v1", "/health"]
    for path in rule["http"]["paths"]:
        assert path["backend"]["service"] == {"name": name, "port": {"name": port["name"]}}
    route = only(objects, "HTTPRoute")
    # The shape of gateway.networking.k8s.io/v1 HTTPRoute (a CRD: no offline schema).
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert set(route["spec"]) == {"parentRefs", "hostnames", "rules"}
    assert route["spec"]["parentRefs"] == [
        {"name": "public-gateway", "namespace": "gateways", "sectionName": "https"}
    ]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (http_rule,) = route["spec"]["rules"]
    assert set(http_rule) <= {"matches", "filters", "backendRefs", "timeouts"}
    assert http_rule["backendRefs"] == [{"name": name, "port": port["port"]}]
    assert http_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert http_rule["timeouts"] == {"request": "600s"}


@pytest.mark.parametrize("name", SETS)
def test_shutdown_is_aligned_with_the_grace_period(rendered: dict[str, Any], name: str) -> None:
    """preStop: the proxy sleeps while endpoints drop the pod, then drains for --drain-timeout;
    vLLM sleeps through both, so requests being finished still reach it; the grace period
    covers all of it."""
    spec = pod_spec(rendered[name])
    vllm, proxy = container(rendered[name], "vllm"), container(rendered[name], "proxy")
    proxy_sleep = proxy["lifecycle"]["preStop"]["exec"]["command"]
    vllm_sleep = vllm["lifecycle"]["preStop"]["exec"]["command"]
    assert proxy_sleep[0] == vllm_sleep[0] == "sleep"  # in both images (coreutils)
    drain = float(flag_value(argv_of(proxy), "--drain-timeout") or "nan")
    assert int(vllm_sleep[1]) >= int(proxy_sleep[1]) + drain
    assert spec["terminationGracePeriodSeconds"] > int(vllm_sleep[1])


def test_chart_drain_default_is_the_proxys() -> None:
    """One default: the chart passes its drainTimeout always (it needs the number for its
    check), so it must be the proxy's own."""
    from vllm_hidden_state_proxy.proxy.settings import ProxySettings

    defaults = {f.name: f.default for f in dataclasses.fields(ProxySettings)}
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["proxy"]["drainTimeout"] == defaults["drain_timeout"]
    assert "the proxy's default (2)" in (CHART_DIR / "values.yaml").read_text()
    assert defaults["metrics_upstream_timeout"] == 2


def test_no_pre_stop_when_switched_off() -> None:
    manifests = render({"preStopSleepSeconds": 0})
    assert "lifecycle" not in container(manifests, "vllm")
    assert "lifecycle" not in container(manifests, "proxy")


# ---------------------------------------------------------------------------------------------
# helm test


class _FakeProxy(BaseHTTPRequestHandler):
    reply: ClassVar[Any] = None
    seen: ClassVar[list[dict[str, Any]]] = []
    #: The key the fake requires, as the proxy with --api-key does (401 otherwise); None: open.
    key: ClassVar[str | None] = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        authorization = self.headers.get("Authorization")
        type(self).seen.append({"path": self.path, "body": body, "authorization": authorization})
        refused = type(self).key is not None and authorization != f"Bearer {type(self).key}"
        data = json.dumps({"error": {"code": 401}} if refused else type(self).reply).encode()
        self.send_response(401 if refused else 200)
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
    _FakeProxy.key = None
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


@pytest.mark.parametrize(
    ("guard", "ok"),
    [
        pytest.param("k3y", True, id="guarded"),
        pytest.param(None, False, id="open-service"),
        pytest.param("other", False, id="wrong-key"),
    ],
)
def test_helm_test_script_checks_the_key(
    fake_proxy: HTTPServer, guard: str | None, ok: bool
) -> None:
    """With API_KEY (the rendered pod's secretKeyRef), the check wants 401 without the key first,
    then a vector with it."""
    _FakeProxy.reply = {"kv_transfer_params": {"last_hidden_state": [0.5] * 8}}
    _FakeProxy.key = guard
    argv, env = chart_commands(values={"tests": {"hiddenSize": 8}})["test"]
    env["PROXY_URL"] = f"http://127.0.0.1:{fake_proxy.server_address[1]}"
    env["API_KEY"] = "k3y"
    result = subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode == 0) is ok, result.stdout + result.stderr
    sent = [request["authorization"] for request in _FakeProxy.seen]
    assert sent == ([None] if guard is None else [None, "Bearer k3y"])
    if ok:
        assert result.stdout.startswith("OK: 8 floats, 401 without the key")
