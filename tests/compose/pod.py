"""One rendered pod of the Helm chart, run in Docker the way kubelet runs it (issue #29).

No cluster can run here, so this module plays the node's part for a single pod spec, taken as
``helm template`` renders it (``tests/deploy/commands.chart_manifests``):

- **the sandbox**: a pause-like container holds the pod's network namespace (every container
  joins it with ``--network container:``, so ``127.0.0.1`` is shared as in a pod), its hostname
  (the pod's name), the Service's port mapping on loopback, and every volume of the pod mounted,
  so that an ``emptyDir`` lives as long as the pod and not as long as one container;
- **volumes** as kubelet's emptyDir plugin makes them: ``medium: Memory`` a tmpfs of
  ``sizeLimit`` mounted *without* a mode (so its root is the kernel's default ``1777``), the
  default medium a directory ``0777``; then ``fsGroup`` applied as kubelet's
  ``SetVolumeOwnership`` does: group ownership, and ``mode | 0660 | setgid | 0110`` on the
  directory. A ``persistentVolumeClaim`` is a host directory given by the caller, bind-mounted
  read-only (as a ReadOnlyMany volume would be: the host's files stay as they are);
- **containers** with the spec's image, ``command`` as the entry point and ``args`` after it,
  ``env`` (literal values, and ``valueFrom.secretKeyRef`` from the Secrets the caller gives, as
  kubelet resolves them; any other ``valueFrom``, and ``envFrom``, is refused) after the
  Service's link variables, its
  ``volumeMounts``, ``resources.limits`` (memory, cpu) as cgroup limits, and ``securityContext``:
  ``runAsUser``/``runAsGroup`` as ``--user``, the pod's ``fsGroup`` as a supplementary group,
  ``readOnlyRootFilesystem`` as ``--read-only``, ``capabilities.drop``,
  ``allowPrivilegeEscalation: false`` as ``no-new-privileges``, ``runAsNonRoot`` checked as
  kubelet checks it. ``initContainers`` run one by one to completion first;
- **probes** polled as kubelet's prober workers do: one thread per probe, first run after
  ``initialDelaySeconds``, then every ``periodSeconds``, ``timeoutSeconds`` per run,
  ``failureThreshold``/``successThreshold`` consecutive results; liveness and readiness wait for
  the startup probe; ``exec`` with ``docker exec`` inside the container, ``httpGet`` (success:
  200-399) and ``tcpSocket`` from the node to the pod's IP, as kubelet connects;
- **restarts** by ``restartPolicy: Always``: a container that exits, or whose startup or
  liveness probe reaches its failure threshold (killed first), is replaced by a new container
  of the same spec in the same sandbox (a fresh root filesystem, the volumes kept). The first
  restart is immediate, later ones back off 10 s, doubling to 300 s, as kubelet's do.

Not simulated: the API server and scheduler, ClusterIP Services and kube-proxy (the Service is a
port mapping to the pod, and its name resolves to the pod's IP for the ``helm test`` pod; an
unready pod is reported, not taken out of any endpoints), the ``KUBERNETES_*`` variables and the
service account, requests (only limits), the memory emptyDir counting against the pod's memory,
seccomp beyond Docker's default profile (which is ``RuntimeDefault``), preStop hooks and the
termination grace period (containers are removed with SIGKILL at the end).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.compose.docker_host import HostError, run
from vllm_hidden_state_proxy.processes import free_port

#: kubelet's emptyDir: directories are created with this mode (the ``0777`` of empty_dir.go).
EMPTY_DIR_MODE = 0o777
#: What kubelet adds to a volume's root for fsGroup (volume_linux.go: rwMask | execMask, setgid).
FS_GROUP_DIR_BITS = 0o2770
#: kubelet's crash-loop back-off: the first restart at once, then 10 s doubling to 300 s.
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0
#: The pause-like container's user (the official pause image runs as 65535).
PAUSE_USER = "65535:65535"
#: How often the node looks at its containers' states (kubelet's PLEG relists every second).
RELIST_SECONDS = 1.0
#: Where the sandbox keeps every volume mounted, so that a tmpfs outlives container restarts.
SANDBOX_VOLUMES = "/pod-volumes"

#: (phase, seconds) of the Helm pod test, printed at the end of the session (conftest).
POD_PHASES: list[tuple[str, float]] = []
#: The pod's events (seconds since its start, what happened), printed the same way.
POD_EVENTS: list[str] = []

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|m)?$")
_FACTORS = {
    None: 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def quantity_bytes(value: str | int) -> int:
    """A Kubernetes quantity of bytes (``1Gi``, ``64Mi``, ``1000``) as an integer."""
    match = _QUANTITY.match(str(value))
    if match is None or match.group(2) == "m":
        raise ValueError(f"not a quantity of bytes: {value!r}")
    return int(float(match.group(1)) * _FACTORS[match.group(2)])


def quantity_cpus(value: str | int) -> float:
    """A Kubernetes CPU quantity (``4``, ``500m``) in CPUs."""
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --------------------------------------------------------------------------------------------------
# Probes


@dataclass(frozen=True)
class Probe:
    """One probe of a container spec, with Kubernetes' defaults for what the spec leaves out."""

    kind: str  # "startup", "liveness" or "readiness"
    spec: Mapping[str, Any]
    ports: Mapping[str, int]  # the container's named ports

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    @property
    def initial_delay(self) -> float:
        return float(self.spec.get("initialDelaySeconds", 0))

    @property
    def failure_threshold(self) -> int:
        return int(self.spec.get("failureThreshold", 3))

    @property
    def success_threshold(self) -> int:
        return int(self.spec.get("successThreshold", 1))

    def port(self, handler: Mapping[str, Any]) -> int:
        port = handler["port"]
        return self.ports[port] if isinstance(port, str) else int(port)

    def check(self, container_id: str, pod_ip: str) -> bool:
        """One run of the probe; True when it succeeds within its timeout."""
        if "exec" in self.spec:
            argv = ["docker", "exec", container_id, *self.spec["exec"]["command"]]
            try:
                done = subprocess.run(
                    argv, capture_output=True, timeout=self.timeout, stdin=subprocess.DEVNULL
                )
            except subprocess.TimeoutExpired:
                return False
            return done.returncode == 0
        if "httpGet" in self.spec:
            handler = self.spec["httpGet"]
            connection = http.client.HTTPConnection(
                pod_ip, self.port(handler), timeout=self.timeout
            )
            try:
                connection.request("GET", handler.get("path", "/"))
                return 200 <= connection.getresponse().status < 400
            except OSError:
                return False
            finally:
                connection.close()
        if "tcpSocket" in self.spec:
            try:
                with socket.create_connection(
                    (pod_ip, self.port(self.spec["tcpSocket"])), timeout=self.timeout
                ):
                    return True
            except OSError:
                return False
        raise ValueError(f"{self.kind} probe: no handler this node knows: {dict(self.spec)}")


@dataclass
class _ContainerState:
    """What the node knows of one container of the pod; guarded by the pod's lock."""

    spec: Mapping[str, Any]
    docker_id: str = ""
    generation: int = 0
    restarts: int = 0
    started: bool = False  # the startup probe succeeded (or there is none)
    ready: bool = False
    kill_reason: str | None = None  # a probe asked for a restart
    next_start: float = 0.0

    @property
    def name(self) -> str:
        return str(self.spec["name"])


# --------------------------------------------------------------------------------------------------
# The pod


@dataclass
class PodEvent:
    seconds: float  # since the pod started
    text: str


@dataclass
class Pod:
    """A pod spec run in Docker by :meth:`start`; ``with pod.running(): ...`` removes it all."""

    name: str
    spec: Mapping[str, Any]
    #: claimName -> host directory holding the claim's files.
    claims: Mapping[str, Path] = field(default_factory=dict)
    #: Secret name -> key -> value (decoded), for ``valueFrom.secretKeyRef``.
    secrets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: The Service: its name, port and target (a named container port or a number).
    service_name: str = ""
    service_port: int = 0
    service_target: str | int = "http"
    service_port_name: str = "http"
    events: list[PodEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._states: dict[str, _ContainerState] = {}
        self._volumes: dict[str, str] = {}  # volume name -> docker volume
        self._network = f"{self.name}-net"
        self._sandbox = f"{self.name}-pause"
        self._t0 = time.monotonic()
        self.pod_ip = ""
        self.host_port = 0

    # -- what the test sees ----------------------------------------------------------------------

    @property
    def service_url(self) -> str:
        """The Service's port, as the node's loopback publishes it."""
        return f"http://127.0.0.1:{self.host_port}"

    def ready(self) -> bool:
        """The pod's Ready condition: every container ready."""
        with self._lock:
            return bool(self._states) and all(s.ready for s in self._states.values())

    def container_ready(self, container: str) -> bool:
        """The container's Ready condition: its readiness probe's verdict (or, without one,
        started and past its startup probe)."""
        with self._lock:
            return self._states[container].ready

    def restarts(self, container: str) -> int:
        with self._lock:
            return self._states[container].restarts

    def container_id(self, container: str) -> str:
        with self._lock:
            return self._states[container].docker_id

    def exec(self, container: str, argv: Sequence[str], timeout: float = 60) -> str:
        """``kubectl exec``: run ``argv`` in the container, as its user."""
        return run(["docker", "exec", self.container_id(container), *argv], timeout=timeout).stdout

    def logs(self, container: str, lines: int = 60) -> str:
        done = run(
            ["docker", "logs", "--tail", str(lines), self.container_id(container)],
            timeout=60,
            check=False,
        )
        return done.stdout + done.stderr

    def all_logs(self, lines: int = 40) -> str:
        with self._lock:
            names = list(self._states)
        parts = [f"--- {name}:\n{self.logs(name, lines)}" for name in names]
        events = "\n".join(f"{e.seconds:7.1f} s  {e.text}" for e in self.events)
        return "\n".join([*parts, f"--- events:\n{events}"])

    def _event(self, text: str) -> None:
        self.events.append(PodEvent(time.monotonic() - self._t0, text))

    # -- lifecycle -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[Pod]:
        try:
            self.start()
            yield self
        finally:
            self.remove()

    def start(self) -> None:
        if self.spec.get("restartPolicy", "Always") != "Always":
            # A Deployment's pods always restart; the node here knows no other policy.
            raise ValueError(f"restartPolicy {self.spec['restartPolicy']} is not simulated")
        self._t0 = time.monotonic()
        run(["docker", "network", "create", self._network], timeout=60)
        self._start_sandbox()
        self._set_up_volumes()
        for init in self.spec.get("initContainers", []):
            self._run_init(init)
        for container in self.spec["containers"]:
            state = _ContainerState(spec=container)
            state.started = "startupProbe" not in container
            self._states[state.name] = state
            self._start_container(state)
            for kind in ("startup", "liveness", "readiness"):
                if f"{kind}Probe" in container:
                    probe = Probe(kind, container[f"{kind}Probe"], _named_ports(container))
                    self._spawn(self._prober, state, probe)
        self._spawn(self._relist)

    def remove(self) -> None:
        """Everything of the pod, gone: threads, containers, the sandbox, volumes, network."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        with self._lock:
            ids = [s.docker_id for s in self._states.values() if s.docker_id]
        for target in [*ids, self._sandbox]:
            run(["docker", "rm", "--force", "--volumes", target], timeout=120, check=False)
        for volume in self._volumes.values():
            run(["docker", "volume", "rm", "--force", volume], timeout=60, check=False)
        run(["docker", "network", "rm", self._network], timeout=60, check=False)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the sandbox and its volumes -------------------------------------------------------------

    def target_port(self) -> int:
        for container in self.spec["containers"]:
            ports = _named_ports(container)
            if isinstance(self.service_target, str) and self.service_target in ports:
                return ports[self.service_target]
        if isinstance(self.service_target, int):
            return self.service_target
        raise ValueError(f"no container port named {self.service_target!r}")

    def _start_sandbox(self) -> None:
        target = self.target_port()
        self.host_port = free_port()
        argv = [
            "docker",
            "run",
            "--detach",
            "--name",
            self._sandbox,
            "--hostname",
            self.name,
            "--network",
            self._network,
            "--publish",
            f"127.0.0.1:{self.host_port}:{target}",
            "--user",
            PAUSE_USER,
        ]
        for volume in self.spec.get("volumes", []):
            argv += ["--mount", self._volume_mount(volume, f"{SANDBOX_VOLUMES}/{volume['name']}")]
        # The image of the pod's last container (the proxy's: Python, small) as the pause image.
        image = self.spec["containers"][-1]["image"]
        argv += ["--entrypoint", "python3", image, "-c", "import signal; signal.pause()"]
        run(argv, timeout=120)
        inspect = json.loads(run(["docker", "inspect", self._sandbox], timeout=60).stdout)
        self.pod_ip = inspect[0]["NetworkSettings"]["Networks"][self._network]["IPAddress"]
        self._event(f"sandbox up, pod IP {self.pod_ip}")

    def _volume_mount(self, volume: Mapping[str, Any], target: str) -> str:
        """A ``--mount`` of the pod volume (created on first use) at ``target``."""
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.claims:
                raise ValueError(f"volume {name}: no directory given for claim {claim!r}")
            return f"type=bind,source={self.claims[claim]},target={target},readonly"
        if "emptyDir" not in volume:
            raise ValueError(f"volume {name}: only emptyDir and persistentVolumeClaim are run here")
        if name not in self._volumes:
            docker_volume = f"{self.name}-{name}"
            create = ["docker", "volume", "create"]
            empty_dir = volume["emptyDir"] or {}
            if empty_dir.get("medium") == "Memory":
                # kubelet's only tmpfs option is the size: no mode, so the root is 1777.
                create += ["--opt", "type=tmpfs", "--opt", "device=tmpfs"]
                if empty_dir.get("sizeLimit"):
                    create += ["--opt", f"o=size={quantity_bytes(empty_dir['sizeLimit'])}"]
            run([*create, docker_volume], timeout=60)
            self._volumes[name] = docker_volume
        # No copy of the image's files into the volume: an emptyDir starts empty.
        return f"type=volume,source={self._volumes[name]},target={target},volume-nocopy"

    def _set_up_volumes(self) -> None:
        """emptyDir's ``0777`` for directories, then ``fsGroup`` as SetVolumeOwnership does."""
        fs_group = (self.spec.get("securityContext") or {}).get("fsGroup")
        paths: dict[str, str] = {}
        for volume in self.spec.get("volumes", []):
            if "emptyDir" in volume:
                memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
                paths[f"{SANDBOX_VOLUMES}/{volume['name']}"] = "memory" if memory else "disk"
        code = f"""
import os, stat
for path, medium in {paths!r}.items():
    if medium == "disk":
        os.chmod(path, {EMPTY_DIR_MODE})
    if {fs_group!r} is not None:
        os.chown(path, -1, {fs_group!r})
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | {FS_GROUP_DIR_BITS})
    print(path, oct(os.stat(path).st_mode))
"""
        done = run(
            ["docker", "exec", "--user", "0", self._sandbox, "python3", "-c", code], timeout=60
        )
        self._event("volumes set up: " + " ".join(done.stdout.split()))

    # -- containers ------------------------------------------------------------------------------

    def _docker_run_argv(
        self,
        container: Mapping[str, Any],
        docker_name: str,
        pod_spec: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """``docker run`` of a container of this pod (or of ``pod_spec``, another pod's)."""
        pod_security = ((pod_spec or self.spec).get("securityContext")) or {}
        security = container.get("securityContext") or {}
        argv = ["docker", "run", "--detach", "--name", docker_name]
        argv += ["--network", f"container:{self._sandbox}"]
        argv += _security_options(container, pod_security, security)
        limits = (container.get("resources") or {}).get("limits") or {}
        if limits.get("memory") is not None:
            argv += ["--memory", str(quantity_bytes(limits["memory"]))]
        if limits.get("cpu") is not None:
            argv += ["--cpus", str(quantity_cpus(limits["cpu"]))]
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume_mount = self._volume_mount(volumes[mount["name"]], mount["mountPath"])
            if mount.get("readOnly"):
                volume_mount += ",readonly"
            argv += ["--mount", volume_mount]
        for name, value in self._service_links().items():
            argv += ["--env", f"{name}={value}"]
        if container.get("envFrom"):
            raise ValueError(f"{container['name']}: envFrom is not simulated")
        for variable in container.get("env", []):
            argv += ["--env", f"{variable['name']}={self._env_value(container, variable)}"]
        command = [str(x) for x in container.get("command", [])]
        if command:
            argv += ["--entrypoint", command[0]]
        argv.append(container["image"])
        return argv + command[1:] + [str(x) for x in container.get("args", [])]

    def _env_value(self, container: Mapping[str, Any], variable: Mapping[str, Any]) -> str:
        """A literal, or a Secret's key; kubelet refuses to create the container
        (CreateContainerConfigError) when the Secret or its key is missing."""
        if "value" in variable:
            return str(variable["value"])
        ref = (variable.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise ValueError(f"{container['name']}: env {variable['name']}: only secretKeyRef")
        try:
            return self.secrets[ref["name"]][ref["key"]]
        except KeyError:
            raise HostError(
                f"{container['name']}: env {variable['name']}: no key {ref['key']!r} in "
                f"Secret {ref['name']!r} (CreateContainerConfigError)"
            ) from None

    def _service_links(self) -> dict[str, str]:
        """The variables kubelet sets for a Service (enableServiceLinks, the default); its
        address here is the pod's own."""
        if not self.service_name or self.spec.get("enableServiceLinks") is False:
            return {}
        prefix = self.service_name.upper().replace("-", "_")
        address, port = self.pod_ip, self.service_port
        url = f"tcp://{address}:{port}"
        return {
            f"{prefix}_SERVICE_HOST": address,
            f"{prefix}_SERVICE_PORT": str(port),
            f"{prefix}_SERVICE_PORT_{self.service_port_name.upper().replace('-', '_')}": str(port),
            f"{prefix}_PORT": url,
            f"{prefix}_PORT_{port}_TCP": url,
            f"{prefix}_PORT_{port}_TCP_PROTO": "tcp",
            f"{prefix}_PORT_{port}_TCP_PORT": str(port),
            f"{prefix}_PORT_{port}_TCP_ADDR": address,
        }

    def _run_init(self, container: Mapping[str, Any], timeout: float = 300) -> None:
        docker_name = f"{self.name}-init-{container['name']}"
        run(self._docker_run_argv(container, docker_name), timeout=120)
        try:
            waited = run(["docker", "wait", docker_name], timeout=timeout).stdout.strip()
            if waited != "0":
                logs = run(["docker", "logs", docker_name], timeout=60, check=False)
                raise HostError(
                    f"init container {container['name']} exited {waited}:\n"
                    f"{logs.stdout}{logs.stderr}"
                )
            self._event(f"init container {container['name']} completed")
        finally:
            run(["docker", "rm", "--force", docker_name], timeout=60, check=False)

    def _start_container(self, state: _ContainerState) -> None:
        """Called with the state not yet shared, or under the lock."""
        docker_name = f"{self.name}-{state.name}-{state.restarts}"
        state.docker_id = run(self._docker_run_argv(state.spec, docker_name), timeout=120).stdout
        state.docker_id = state.docker_id.strip()
        state.generation += 1
        state.started = "startupProbe" not in state.spec
        state.ready = False
        state.kill_reason = None
        self._event(f"container {state.name} started ({docker_name})")

    # -- the node's loops ------------------------------------------------------------------------

    def _relist(self) -> None:
        """Containers that exited, or that a probe condemned, are replaced (restartPolicy
        Always), after kubelet's back-off."""
        while not self._stop.wait(RELIST_SECONDS):
            with self._lock:
                states = list(self._states.values())
            for state in states:
                running = _is_running(state.docker_id)
                with self._lock:
                    reason = state.kill_reason or (None if running else "exited")
                    if reason is None:
                        if not state.spec.get("readinessProbe"):
                            state.ready = state.started
                        continue
                    if state.next_start == 0.0:
                        if running:  # a failed startup or liveness probe: kubelet kills it
                            run(["docker", "kill", state.docker_id], timeout=60, check=False)
                        state.ready = False
                        delay = (
                            0.0
                            if state.restarts == 0
                            else BACKOFF_START * 2 ** (state.restarts - 1)
                        )
                        state.next_start = time.monotonic() + min(delay, BACKOFF_MAX)
                        self._event(f"container {state.name}: {reason}; restart in {delay:.0f} s")
                    if time.monotonic() < state.next_start:
                        continue
                    old = state.docker_id
                    state.restarts += 1
                    state.next_start = 0.0
                    self._start_container(state)
                run(["docker", "rm", "--force", old], timeout=120, check=False)

    def _prober(self, state: _ContainerState, probe: Probe) -> None:
        generation = -1
        successes = failures = 0
        due = 0.0
        while not self._stop.wait(0.2):
            with self._lock:
                if state.generation != generation:  # a new container: a new worker, in effect
                    generation, successes, failures = state.generation, 0, 0
                    due = time.monotonic() + probe.initial_delay
                gated = probe.kind != "startup" and not state.started
                done = probe.kind == "startup" and state.started
                docker_id = state.docker_id
                condemned = state.kill_reason is not None
            if gated or done or condemned or time.monotonic() < due:
                continue
            due = time.monotonic() + probe.period
            ok = probe.check(docker_id, self.pod_ip)
            with self._lock:
                if state.generation != generation:
                    continue
                successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
                if probe.kind == "readiness":
                    if ok and successes >= probe.success_threshold and not state.ready:
                        state.ready = True
                        self._event(f"container {state.name} ready")
                    elif not ok and failures >= probe.failure_threshold and state.ready:
                        state.ready = False
                        self._event(f"container {state.name} not ready ({failures} failures)")
                elif ok and probe.kind == "startup":
                    state.started = True
                    self._event(f"container {state.name} started (startup probe)")
                elif not ok and failures >= probe.failure_threshold:
                    state.kill_reason = f"{probe.kind} probe failed {failures} times"
                    self._event(f"container {state.name}: {state.kill_reason}")


def _named_ports(container: Mapping[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports", []) if "name" in p}


def _is_running(docker_id: str) -> bool:
    done = run(
        ["docker", "inspect", "--format", "{{.State.Running}}", docker_id], timeout=60, check=False
    )
    return done.stdout.strip() == "true"


def _security_options(
    container: Mapping[str, Any], pod: Mapping[str, Any], security: Mapping[str, Any]
) -> list[str]:
    """``docker run`` options for a container's securityContext (over the pod's)."""
    merged = {**{k: v for k, v in pod.items() if k in ("runAsUser", "runAsGroup")}, **security}
    user, group = merged.get("runAsUser"), merged.get("runAsGroup")
    if merged.get("runAsNonRoot") and not user:
        # kubelet refuses to start it (CreateContainerConfigError) when it cannot verify a
        # non-root uid; the chart always sets one where it asks for non-root.
        raise ValueError(f"{container['name']}: runAsNonRoot without a non-zero runAsUser")
    argv: list[str] = []
    if user is not None:
        argv += ["--user", f"{user}:{group if group is not None else 0}"]
    if pod.get("fsGroup") is not None:
        argv += ["--group-add", str(pod["fsGroup"])]
    for extra in pod.get("supplementalGroups", []):
        argv += ["--group-add", str(extra)]
    if security.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if security.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    for capability in (security.get("capabilities") or {}).get("drop", []):
        argv += ["--cap-drop", capability]
    for capability in (security.get("capabilities") or {}).get("add", []):
        argv += ["--cap-add", capability]
    if security.get("privileged"):
        argv.append("--privileged")
    profile = (security.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
    if profile not in (None, "RuntimeDefault"):
        raise ValueError(f"{container['name']}: seccompProfile {profile} is not simulated")
    return argv


def run_to_completion(pod: Pod, test_pod: Mapping[str, Any], timeout: float) -> tuple[int, str]:
    """A ``restartPolicy: Never`` pod of one container (``helm test``'s) beside ``pod``, on its
    network, with the Service's name resolving to ``pod``: its exit code and output."""
    spec = test_pod["spec"]
    if spec.get("volumes") or len(spec["containers"]) != 1:
        raise ValueError("only a test pod of one container and no volumes is run here")
    docker_name = f"{pod.name}-test"
    argv = pod._docker_run_argv(spec["containers"][0], docker_name, pod_spec=spec)
    # Its own network namespace on the pod's network, not the pod's: replace the sandbox's.
    at = argv.index("--network")
    argv[at + 1 : at + 2] = [pod._network, "--add-host", f"{pod.service_name}:{pod.pod_ip}"]
    run(argv, timeout=120)
    try:
        code = run(["docker", "wait", docker_name], timeout=timeout).stdout.strip()
        logs = run(["docker", "logs", docker_name], timeout=60, check=False)
        return int(code), logs.stdout + logs.stderr
    finally:
        run(["docker", "rm", "--force", docker_name], timeout=60, check=False)
