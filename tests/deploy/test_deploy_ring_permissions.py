"""The permission model of the deployment files, on a real filesystem with the real ring code.

In both compose and the chart, vLLM runs as root and the proxy as the proxy image's user
(10001:10001). The ring directory is the shared volume itself, which exists before vLLM starts:
group 10001 with the setgid bit (compose: tmpfs `mode=2770,gid=10001`; Kubernetes: an emptyDir with
`fsGroup: 10001`, which kubelet makes group-owned and setgid). The ring files vLLM creates there
inherit group 10001, and HIDDEN_STATE_PROXY_RING_DIR_MODE=0770 makes them 0640 (and allows the
group-writable volume; a world-writable default-medium emptyDir loses its write bit for others to
the hook, and the chart's init container makes kubelet's sticky memory emptyDir drwxrws---, which
the hook would refuse as it comes). This test plays both users (it needs root) and reads a
published vector as the proxy's user.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.commands import (
    CHART_DIR,
    DOCKER_DIR,
    REPO,
    chart_commands,
    chart_manifests,
    compose_commands,
    image_config,
)
from tests.deploy.deploy_helpers import objects_of, only

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as two users"
)

_READER = r"""
import json, sys
from vllm_hidden_state_proxy.ring import Record, RingDirectory
ring = RingDirectory(sys.argv[1], owner_uids=0)  # the proxy trusts root's (vLLM's) rings
try:
    record = ring.lookup(bytes.fromhex(sys.argv[2]))
    floats = record.floats(record.layers[0]) if isinstance(record, Record) else None
    print(json.dumps({"vector": floats, "live": ring.has_ring()}))
finally:
    ring.close()
"""


def proxy_ids() -> tuple[int, int]:
    uid, _, gid = image_config(DOCKER_DIR / "proxy.Dockerfile")["user"].partition(":")
    return int(uid), int(gid)


def deployment_ring_mode() -> str:
    modes = {
        compose_commands({})["vllm"][1]["HIDDEN_STATE_PROXY_RING_DIR_MODE"],
        compose_commands({}, service="proxy-cpu")["vllm"][1]["HIDDEN_STATE_PROXY_RING_DIR_MODE"],
        chart_commands(CHART_DIR / "ci" / "cpu-values.yaml")["vllm"][1][
            "HIDDEN_STATE_PROXY_RING_DIR_MODE"
        ],
    }
    assert len(modes) == 1, modes
    return modes.pop()


@pytest.fixture
def shared_base() -> Iterator[Path]:
    # pytest's tmp_path lives under a 0700 root directory the proxy user cannot traverse.
    base = Path(
        tempfile.mkdtemp(
            prefix="deploy-ring-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def publish_as_vllm(ring_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[float]]:
    """Publish one vector with the modes the deployment's HIDDEN_STATE_PROXY_RING_DIR_MODE gives
    the hook, as vLLM (root) does."""
    from vllm_hidden_state_proxy.ring import RingWriter
    from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

    monkeypatch.setenv("HIDDEN_STATE_PROXY_RING_DIR_MODE", deployment_ring_mode())
    dir_mode, file_mode = HookSettings().ring_modes
    writer = RingWriter.create(
        ring_dir,
        hidden_size=4,
        model="m",
        slot_count=4,
        instance=0x5EED,
        engine=0,
        dir_mode=dir_mode,
        file_mode=file_mode,
    )
    key = os.urandom(16)
    vector = [0.5, -1.0, 2.0, 0.25]
    writer.publish(key, struct.pack("<4f", *vector), position=6, num_prompt_tokens=7)
    writer.close()
    return key.hex(), vector


def _as_proxy(argv: list[str]) -> subprocess.CompletedProcess[str]:
    uid, gid = proxy_ids()
    # The package's source and this environment's site-packages (msgpack), for an interpreter of
    # the same version that the unprivileged user can run.
    path = os.pathsep.join([str(REPO / "src"), *site.getsitepackages()])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        argv,
        user=uid,
        group=gid,
        extra_groups=[],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


@pytest.fixture(scope="module")
def proxy_python() -> str:
    """An interpreter the unprivileged user may run (the venv's may live under a 0700 home)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin")):
        if candidate:
            try:
                probe = _as_proxy([candidate, "-c", "import vllm_hidden_state_proxy.ring"])
            except OSError:
                continue
            if probe.returncode == 0:
                return candidate
    pytest.skip("no Python interpreter that the proxy's uid can run and import the package with")


def read_as_proxy(python: str, ring_dir: Path, key: str) -> subprocess.CompletedProcess[str]:
    return _as_proxy([python, "-c", _READER, str(ring_dir), key])


def run_chart_init(ring_dir: Path) -> None:
    """The chart's ``ring-permissions`` init container, run here on ``ring_dir`` (root, as in the
    pod): its exact argv, with the ring directory's path and the interpreter made local."""
    spec = only(objects_of(chart_manifests(CHART_DIR / "ci" / "cpu-values.yaml")), "Deployment")
    (init,) = spec["spec"]["template"]["spec"]["initContainers"]
    ring_mount = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "ring")
    argv = [str(arg) for arg in init["command"] + init.get("args", [])]
    assert argv[0] == "python3"
    local = [sys.executable] + [str(ring_dir) if arg == ring_mount else arg for arg in argv[1:]]
    subprocess.run(local, check=True, timeout=60)


@pytest.mark.parametrize(
    ("volume_mode", "init"),
    [
        pytest.param(0o2770, False, id="compose-tmpfs"),
        # kubelet: a default-medium emptyDir is a directory made 0777, fsGroup adds setgid.
        pytest.param(0o2777, False, id="k8s-disk-emptydir-fsgroup"),
        # kubelet: a memory emptyDir is a tmpfs mounted without a mode (root 1777, sticky), then
        # fsGroup; the chart's init container makes it drwxrws--- before vLLM starts.
        pytest.param(0o3777, True, id="k8s-memory-emptydir-fsgroup-chart-init"),
    ],
)
def test_proxy_user_reads_what_root_vllm_writes(
    shared_base: Path,
    monkeypatch: pytest.MonkeyPatch,
    proxy_python: str,
    volume_mode: int,
    init: bool,
) -> None:
    ring_dir = shared_base / "ring"
    ring_dir.mkdir()
    os.chown(ring_dir, 0, proxy_ids()[1])
    os.chmod(ring_dir, volume_mode)
    if init:
        run_chart_init(ring_dir)
        assert stat.S_IMODE(ring_dir.stat().st_mode) == 0o2770
        volume_mode = 0o2770
    key, vector = publish_as_vllm(ring_dir, monkeypatch)
    (ring_file,) = [p for p in ring_dir.iterdir() if not p.name.startswith(".")]
    assert ring_file.name == "ring-0000000000005eed-dp0.bin"
    assert ring_file.stat().st_gid == proxy_ids()[1]  # inherited through the setgid directory
    assert stat.S_IMODE(ring_file.stat().st_mode) == 0o640  # group-readable, never writable
    # The hook (root, the owner) took away what only the world-writable emptyDir granted.
    assert stat.S_IMODE(ring_dir.stat().st_mode) == volume_mode & ~0o002
    result = read_as_proxy(proxy_python, ring_dir, key)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"vector": vector, "live": False}  # the writer closed


def test_memory_emptydir_without_the_chart_init_is_refused(
    shared_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the chart has its init container: the hook will not take over kubelet's memory
    emptyDir as it comes (sticky and world-writable, like /tmp)."""
    from vllm_hidden_state_proxy.ring.files import UntrustedDirectory

    ring_dir = shared_base / "ring"
    ring_dir.mkdir()
    os.chown(ring_dir, 0, proxy_ids()[1])
    os.chmod(ring_dir, 0o3777)
    with pytest.raises(UntrustedDirectory, match="sticky"):
        publish_as_vllm(ring_dir, monkeypatch)


def test_without_the_shared_group_the_proxy_reads_nothing(
    shared_base: Path, monkeypatch: pytest.MonkeyPatch, proxy_python: str
) -> None:
    """Control: a plain root directory (no setgid group) keeps the proxy out. It lists the
    directory, but the ring file is root's group's (0640): the proxy refuses it, saying so, and
    finds no vector; any other failure (a crash, another refusal) fails the test."""
    ring_dir = shared_base / "ring"
    ring_dir.mkdir()
    os.chmod(ring_dir, 0o755)
    key, _ = publish_as_vllm(ring_dir, monkeypatch)
    (ring_file,) = [p for p in ring_dir.iterdir() if not p.name.startswith(".")]
    assert (ring_file.stat().st_gid, stat.S_IMODE(ring_file.stat().st_mode)) == (0, 0o640)
    result = read_as_proxy(proxy_python, ring_dir, key)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"vector": None, "live": False}
    refusal = f"refusing ring file {ring_file}: cannot open: Permission denied"
    assert refusal in result.stderr, result.stderr
