"""compose.yaml: valid against the compose-spec schema, and wired as the issue asks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.commands import (
    COMPOSE_FILE,
    DOCKER_DIR,
    compose_commands,
    image_config,
    load_compose,
)
from tests.deploy.deploy_helpers import declared_args, flag_value
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
PAIRS = [("vllm", "proxy"), ("vllm-cpu", "proxy-cpu")]


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose({})


def duration_seconds(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_matches_the_compose_spec() -> None:
    result = check_compose_schema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_can_fail(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["proxy"]["depends_on"]["vllm"]["condition"] = "service_ready"
    broken["services"]["vllm"]["healthchek"] = {}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = check_compose_schema(path)
    assert result.returncode == 1
    assert "healthchek" in result.stdout


def test_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"vllm", "proxy", "vllm-cpu", "proxy-cpu"}
    # Each pair is a profile, so `--profile cpu` starts (and builds) the CPU pair alone: no GPU
    # service, no pull of vllm/vllm-openai, no second proxy on the same published port.
    assert services["vllm"]["profiles"] == ["gpu"] == services["proxy"]["profiles"]
    assert services["vllm-cpu"]["profiles"] == ["cpu"] == services["proxy-cpu"]["profiles"]


def test_runs_on_engine_20_10(compose: dict[str, Any]) -> None:
    """Compose v2 (the top-level `name`), but no `healthcheck.start_interval`: Compose refuses it
    on Docker Engine older than 25, and Debian 12's engine is 20.10 (the one tests/compose runs)."""
    assert compose["name"] == "vllm-hidden-state"
    for name, service in compose["services"].items():
        assert "start_interval" not in service["healthcheck"], name
        assert duration_seconds(service["healthcheck"]["interval"]) <= 10, name


#: Build arguments and the environment variables compose.yaml fills them from.
BUILD_SETTINGS = {
    "proxy": {"BASE_IMAGE": "PYTHON_BASE_IMAGE"},
    "proxy-cpu": {"BASE_IMAGE": "PYTHON_BASE_IMAGE"},
    "vllm-cpu": {"BASE_IMAGE": "PYTHON_BASE_IMAGE", "TORCH_INDEX_URL": "TORCH_INDEX_URL"},
    "vllm": {"BASE_IMAGE": "VLLM_BASE_IMAGE"},
}
PIP_SETTINGS = {"PIP_INDEX_URL": "PIP_INDEX_URL", "PIP_TRUSTED_HOST": "PIP_TRUSTED_HOST"}


@pytest.mark.parametrize("name", sorted(BUILD_SETTINGS))
def test_build_arguments_from_the_environment(compose: dict[str, Any], name: str) -> None:
    """Every build argument is one the Dockerfile declares, with the Dockerfile's default, and
    comes from the environment variable the header documents."""
    build = compose["services"][name]["build"]
    dockerfile = COMPOSE_FILE.parent / build["context"] / build["dockerfile"]
    declared = declared_args(dockerfile)
    settings = BUILD_SETTINGS[name] | PIP_SETTINGS
    assert set(build["args"]) == set(settings)
    for arg, value in build["args"].items():
        assert value == declared[arg], f"{name}: {arg} default {value!r} != {declared[arg]!r}"
    overridden = load_compose({variable: f"x-{arg}" for arg, variable in settings.items()})
    assert overridden["services"][name]["build"]["args"] == {arg: f"x-{arg}" for arg in settings}
    assert "network" not in build  # the default network: only the test builds on the host's
    header = COMPOSE_FILE.read_text().split("\nname:")[0]
    for variable in settings.values():
        assert re.search(rf"^#\s+{variable}\s", header, re.MULTILINE), variable


@pytest.mark.parametrize(("vllm", "proxy"), PAIRS)
def test_only_the_proxy_port_is_published(compose: dict[str, Any], vllm: str, proxy: str) -> None:
    """On the host's loopback by default: without a key the port is open to whoever reaches it."""
    services = compose["services"]
    assert "ports" not in services[vllm]
    assert services[proxy]["ports"] == ["127.0.0.1:8000:8000"]
    published = load_compose({"PROXY_PORT": "9000", "PROXY_BIND": "0.0.0.0"})
    assert published["services"][proxy]["ports"] == ["0.0.0.0:9000:8000"]
    assert flag_value(compose_commands(service=proxy)["proxy"][0], "--port") == "8000"


def test_the_header_shows_the_key_first() -> None:
    """The key and the bind address are told before the list of settings, together."""
    header = COMPOSE_FILE.read_text().split("\nname:")[0]
    key = header.index("HIDDEN_STATE_PROXY_API_KEY=")
    assert key < header.index("# Settings")
    assert "PROXY_BIND=0.0.0.0" in header[key - 200 : key + 200]


@pytest.mark.parametrize("name", ["vllm", "proxy", "vllm-cpu", "proxy-cpu"])
def test_stop_grace_period_covers_the_proxys_drain(compose: dict[str, Any], name: str) -> None:
    drain = ProxySettings(upstream_url="http://vllm:8001").drain_timeout
    assert duration_seconds(compose["services"][name]["stop_grace_period"]) >= drain + 5


@pytest.mark.parametrize(("vllm", "proxy"), PAIRS)
def test_proxy_waits_for_healthy_vllm(compose: dict[str, Any], vllm: str, proxy: str) -> None:
    services = compose["services"]
    assert services[proxy]["depends_on"] == {vllm: {"condition": "service_healthy"}}
    check = services[vllm]["healthcheck"]
    vllm_argv = compose_commands(service=proxy)["vllm"][0]
    port = flag_value(vllm_argv, "--port")
    assert check["test"][0] == "CMD"
    assert f"'http://127.0.0.1:{port}/health'" in check["test"][-1]
    assert duration_seconds(check["start_period"]) >= 10 * 60  # model download and load
    upstream = flag_value(compose_commands(service=proxy)["proxy"][0], "--upstream")
    assert upstream == f"http://{vllm}:{port}"
    assert flag_value(vllm_argv, "--host") == "0.0.0.0"  # reachable on the compose network


def test_vllm_health_command_fails_without_vllm(compose: dict[str, Any]) -> None:
    test = compose["services"]["vllm"]["healthcheck"]["test"]
    code = test[-1].replace("127.0.0.1:8001", "127.0.0.1:1")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


@pytest.mark.parametrize(("vllm", "proxy"), PAIRS)
def test_ring_on_shared_memory(compose: dict[str, Any], vllm: str, proxy: str) -> None:
    services = compose["services"]

    def ring_mounts(name: str) -> list[dict[str, Any]]:
        return [v for v in services[name]["volumes"] if v["source"] == "ring"]

    (vllm_mount,), (proxy_mount,) = ring_mounts(vllm), ring_mounts(proxy)
    assert vllm_mount["target"] == proxy_mount["target"]
    assert vllm_mount["type"] == proxy_mount["type"] == "volume"
    assert vllm_mount["volume"]["nocopy"] is True and proxy_mount["volume"]["nocopy"] is True
    volume = compose["volumes"]["ring"]
    assert volume["driver_opts"]["type"] == "tmpfs"
    commands = compose_commands(service=proxy)
    ring_dir = commands["vllm"][1]["HIDDEN_STATE_PROXY_RING_DIR"]
    assert commands["proxy"][1]["HIDDEN_STATE_PROXY_RING_DIR"] == ring_dir
    assert flag_value(commands["proxy"][0], "--ring-dir") == ring_dir
    assert ring_dir == vllm_mount["target"]  # pre-existing: keeps the volume's setgid group
    assert "shm_size" in services[vllm]


def test_ring_group_matches_the_proxy_user(compose: dict[str, Any]) -> None:
    """vLLM (root) writes the ring files into a setgid tmpfs owned by the proxy image's group."""
    options = dict(
        item.split("=", 1) for item in compose["volumes"]["ring"]["driver_opts"]["o"].split(",")
    )
    user = image_config(DOCKER_DIR / "proxy.Dockerfile")["user"]
    assert options["gid"] == user.split(":")[1]
    mode = int(options["mode"], 8)
    assert mode & 0o2000 and mode & 0o070 == 0o070  # setgid, group rwx
    for _, proxy in PAIRS:
        for _, env in compose_commands(service=proxy).values():
            assert int(env["HIDDEN_STATE_PROXY_RING_DIR_MODE"], 8) & 0o050 == 0o050


def test_settings_from_environment() -> None:
    default_vllm = compose_commands({})["vllm"]
    assert flag_value(default_vllm[0], "--model") == "Qwen/Qwen3-0.6B"
    assert "HF_TOKEN" not in default_vllm[1]
    argv, env = compose_commands(
        {
            "MODEL": "org/model",
            "VLLM_EXTRA_ARGS": "--max-model-len 8192 --enforce-eager",
            "HF_TOKEN": "hf_x",
            "PROXY_EXTRA_ARGS": "--vector-timeout 30",
        }
    )["vllm"]
    assert flag_value(argv, "--model") == "org/model"
    assert argv[-3:] == ["--max-model-len", "8192", "--enforce-eager"]
    assert env["HF_TOKEN"] == "hf_x"
    proxy_argv = compose_commands({"PROXY_EXTRA_ARGS": "--vector-timeout 30"})["proxy"][0]
    assert proxy_argv[-2:] == ["--vector-timeout", "30"]


def test_model_cache_is_the_hosts(compose: dict[str, Any]) -> None:
    """The host's Hugging Face cache, bind-mounted (HF_CACHE, else $HOME's), never made by
    Docker when missing; vLLM's HF_HOME; not in the proxy."""
    for vllm, proxy in PAIRS:
        for env, source in (
            ({"HOME": "/home/u"}, "/home/u/.cache/huggingface"),
            ({"HOME": "/home/u", "HF_CACHE": "/data/hf"}, "/data/hf"),
        ):
            services = load_compose(env)["services"]
            (cache,) = [v for v in services[vllm]["volumes"] if v["source"] == source]
            assert cache["type"] == "bind"
            assert cache["bind"] == {"create_host_path": False}
            assert compose_commands(env, service=proxy)["vllm"][1]["HF_HOME"] == cache["target"]
            assert source not in {v["source"] for v in services[proxy]["volumes"]}
    assert "hf-cache" not in compose.get("volumes", {})


def test_gpu_pair_and_cpu_pair(compose: dict[str, Any]) -> None:
    services = compose["services"]
    (device,) = services["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] == "all"
    assert (
        load_compose({"GPU_COUNT": "2"})["services"]["vllm"]["deploy"]["resources"]["reservations"][
            "devices"
        ][0]["count"]
        == "2"
    )
    for name in ("vllm-cpu", "proxy-cpu", "proxy"):
        assert "deploy" not in services[name]
    assert services["vllm"]["build"]["dockerfile"] == "deploy/docker/vllm.Dockerfile"
    assert services["vllm-cpu"]["build"]["dockerfile"] == "deploy/docker/vllm-cpu.Dockerfile"
    assert services["vllm-cpu"]["image"].endswith("-cpu")
    assert services["vllm"]["image"].endswith("-gpu")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HIDDEN_STATE_PROXY_EMBEDDING_TEMPLATE", "q: {text}"),
        ("HIDDEN_STATE_PROXY_API_KEY", "client-key"),
        ("HIDDEN_STATE_PROXY_UPSTREAM_API_KEY", "vllm-key"),
    ],
)
def test_proxy_settings_only_when_set(name: str, value: str) -> None:
    """The proxy's pass-through settings reach the proxy (and only it) when set, else nothing."""
    for _, proxy in PAIRS:
        assert name not in compose_commands(service=proxy)["proxy"][1]
        commands = compose_commands({name: value}, service=proxy)
        assert commands["proxy"][1][name] == value
        assert name not in commands["vllm"][1]


def test_proxy_hardening(compose: dict[str, Any]) -> None:
    for _, proxy in PAIRS:
        service = compose["services"][proxy]
        assert service["read_only"] is True
        assert service["cap_drop"] == ["ALL"]
        assert service["build"]["dockerfile"] == "deploy/docker/proxy.Dockerfile"
        assert "user" not in service  # the image's non-root USER
