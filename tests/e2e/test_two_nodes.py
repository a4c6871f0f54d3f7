"""Data parallel across two nodes with hybrid load balancing, simulated on one machine (#29).

docs/deploy.md's layout: each node runs its own vLLM API server in front of its local engines
(``--data-parallel-size-local N --data-parallel-hybrid-lb``, node 1 with
``--data-parallel-start-rank N``, both given node 0's ``--data-parallel-address`` and
``--data-parallel-rpc-port``), and one proxy per node in front of that node's API server, reading
that node's ring directory.

A "node" here is a network namespace (its own address on a bridge) and a mount namespace with a
private tmpfs on /dev/shm, so neither node can see the other's rings: a proxy that found a
vector would have found it in its own node's memory. The clients run in a third namespace (the
"LAN", which holds the bridge), so every request crosses a veth as it would cross a network.
Only addresses inside these namespaces are used (10.213.0.0/24), never the host's.

With one engine per node (``--data-parallel-size 2 --data-parallel-size-local 1``), vLLM 0.32
itself fails at startup, with the hook disabled too (:data:`VLLM_FAILURE`): a test asserts
exactly that failure, hook disabled and enabled, so it flips when vLLM fixes it. With two
engines per node (``--data-parallel-size 4 --data-parallel-size-local 2``, where vLLM keeps
hybrid load balancing) the whole scenario runs: flagged requests to both proxies at once, each
node's requests finished by its own engines, node 1's engines killed and node 0 still serving.

Root only (namespaces and mounts); everything is removed in ``finally``. Runs in the second
pytest session (``own_server``) and holds the machine-wide vLLM lock for both nodes at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.chat_requests import NO_THINKING
from tests.e2e.reference import COUNTED, Reference, assert_matches
from tests.e2e.server import MAX_MODEL_LEN, SERVED_MODEL_NAME, STARTUP_TIMEOUT
from tests.e2e.stack_probe import proxy_gauge_in, served_per_engine
from vllm_hidden_state_proxy.processes import (
    offline_environment,
    one_vllm_at_a_time,
    stop_process_group,
)
from vllm_hidden_state_proxy.protocol import HOOK_ENABLED_ENV, RING_DIR_ENV

pytestmark = [
    pytest.mark.own_server,
    pytest.mark.skipif(os.geteuid() != 0, reason="network and mount namespaces need root"),
    pytest.mark.skipif(
        not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter", "mount")),
        reason="needs ip (iproute2), unshare, nsenter and mount",
    ),
]

#: The simulated LAN: node i at 10.213.0.(i+1), the clients (and the bridge) at .3.
SUBNET_PREFIX = "10.213.0."
CLIENT_ADDRESS = SUBNET_PREFIX + "3"
#: vLLM's own example ports for multi-node data parallelism (docs/deploy.md): the API server on
#: 8000 on every node, the proxy in front of it on 8080, node 0's DP RPC port 13345.
VLLM_PORT = 8000
PROXY_PORT = 8080
DP_RPC_PORT = 13345
#: Inside each node's own /dev/shm (a private tmpfs), so the name can be the same on both.
NODE_RING_DIR = "/dev/shm/hidden-states"
NODE_SHM_SIZE = "1g"
FLAG = {"return_last_hidden_state": True}
#: Requests a node's engine still serves after the other node's engine is killed.
AFTER_KILL = 8

_CLONE_NEWNET = 0x40000000
#: A mount namespace of its own whose mounts (the node's /dev/shm) never reach the host's.
UNSHARE_MOUNT = ("unshare", "--mount", "--propagation", "private")


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def simulated_lan(tag: str, nodes: int) -> Iterator[list[str]]:
    """Network namespaces ``<tag>-n<i>`` (node i, ``eth0`` at 10.213.0.(i+1)) and ``<tag>-lan``
    (a bridge at .3 joining them); yields the node namespaces. Deleting a namespace deletes its
    end of each veth pair, and with it the other end."""
    lan = f"{tag}-lan"
    names = [f"{tag}-n{index}" for index in range(nodes)]
    created: list[str] = []
    try:
        for name in (lan, *names):
            _run("ip", "netns", "add", name)
            created.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", lan, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", lan, "addr", "add", f"{CLIENT_ADDRESS}/24", "dev", "br0")
        _run("ip", "-n", lan, "link", "set", "br0", "up")
        for index, name in enumerate(names):
            # Created in the root namespace (names at most 15 bytes), moved out at once.
            inner, outer = f"{tag}e{index}", f"{tag}p{index}"
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "link", "set", outer, "netns", lan)
            _run("ip", "link", "set", inner, "netns", name)
            _run("ip", "-n", name, "link", "set", inner, "name", "eth0")
            _run("ip", "-n", name, "addr", "add", f"{SUBNET_PREFIX}{index + 1}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", lan, "link", "set", outer, "master", "br0")
            _run("ip", "-n", lan, "link", "set", outer, "up")
        yield names
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        for index in range(nodes):  # a veth still in the root namespace after a failure
            subprocess.run(
                ["ip", "link", "del", f"{tag}e{index}"], check=False, capture_output=True
            )


@dataclass
class Node:
    """One simulated node: a process that holds its network and mount namespaces, in which
    its vLLM and its proxy are started (``nsenter``, which execs: their pids are our children's)."""

    index: int
    holder: subprocess.Popen[bytes]
    work_dir: Path

    @property
    def address(self) -> str:
        return f"{SUBNET_PREFIX}{self.index + 1}"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.address}:{PROXY_PORT}"

    @property
    def ring_dir(self) -> Path:
        """The node's ring directory as this process sees it: through the holder's root."""
        return Path(f"/proc/{self.holder.pid}/root{NODE_RING_DIR}")

    def start(self, name: str, command: Sequence[str], env: dict[str, str]) -> Process:
        log = self.work_dir / f"node{self.index}-{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return Process(f"node {self.index}'s {name}", process, log)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} ({self.log}):\n" + "\n".join(text[-lines:])


@contextlib.contextmanager
def node(namespace: str, index: int, work_dir: Path) -> Iterator[Node]:
    """Node ``index``: a holder in ``namespace`` with a private mount namespace whose /dev/shm
    is a fresh tmpfs (so the node's rings and vLLM's own shared memory are its own)."""
    script = f"mount -t tmpfs -o size={NODE_SHM_SIZE},mode=1777 tmpfs /dev/shm && exec sleep inf"
    log = work_dir / f"node{index}.log"
    with open(log, "wb") as out:
        holder = subprocess.Popen(
            [*("ip", "netns", "exec", namespace), *UNSHARE_MOUNT, "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # The shell execs ``sleep`` only once the tmpfs is mounted.
        deadline = time.monotonic() + 30
        while _cmdline(holder.pid)[:1] != ["sleep"]:
            if holder.poll() is not None:
                raise RuntimeError(f"node {index} did not start: {log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {index}'s namespaces were not ready in 30 s")
            time.sleep(0.05)
        yield Node(index, holder, work_dir)
    finally:
        # The tmpfs goes with the last process of the mount namespace.
        holder.kill()
        holder.wait()


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def vllm_command(model_dir: Path, node: Node, engines_per_node: int) -> list[str]:
    """docs/deploy.md's hybrid-LB command line for ``node`` of two, ``engines_per_node`` engines
    each (node 1's ranks start after node 0's)."""
    start_rank = ["--data-parallel-start-rank", str(node.index * engines_per_node)]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        node.address,
        "--port",
        str(VLLM_PORT),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "32",
        "--data-parallel-size",
        str(2 * engines_per_node),
        "--data-parallel-size-local",
        str(engines_per_node),
        "--data-parallel-hybrid-lb",
        "--data-parallel-address",
        f"{SUBNET_PREFIX}1",
        "--data-parallel-rpc-port",
        str(DP_RPC_PORT),
        *(start_rank if node.index else []),
    ]


def vllm_environment(node: Node, hook: bool, engines_per_node: int) -> dict[str, str]:
    env = offline_environment()
    # One core and a small KV cache per engine: one engine per node, node i on core i; two per
    # node, each node's on cores 0 and 1 (the two nodes share this machine's two cores).
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(node.index) if engines_per_node == 1 else "0|1"
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env[RING_DIR_ENV] = NODE_RING_DIR
    env[HOOK_ENABLED_ENV] = "1" if hook else "0"
    return env


def proxy_command(node: Node) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_hidden_state_proxy.cli",
        "proxy",
        "--upstream",
        f"http://{node.address}:{VLLM_PORT}",
        "--host",
        node.address,
        "--port",
        str(PROXY_PORT),
        "--ring-dir",
        NODE_RING_DIR,
    ]


def in_network_namespace(namespace: str) -> Callable[[], None]:
    """A thread initializer that moves its thread into ``namespace``'s network: the sockets
    that thread opens are then the LAN's. (setns changes only the calling thread's namespace.)"""

    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{namespace}") as handle:
            if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")

    return enter


def lan_client(url: str, timeout: float = 300) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout, trust_env=False)


def wait_for(
    check: Callable[[], bool], what: str, processes: Sequence[Process], timeout: float
) -> None:
    """Poll ``check`` until true; fail with the logs if a process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not check():
        for process in processes:
            if process.popen.poll() is not None:
                logs = "\n".join(p.tail() for p in processes)
                raise AssertionError(
                    f"{process.name} exited ({process.popen.returncode}) before {what}\n{logs}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(p.tail() for p in processes)
            raise AssertionError(f"not {what} after {timeout:.0f} s\n{logs}")
        time.sleep(0.5)


def status(url: str) -> int | None:
    try:
        with lan_client(url, timeout=5) as client:
            return client.get("/health").status_code
    except httpx.HTTPError:
        return None


def chat_body(node: int, index: int, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Node {node}, question {index}: " + "hills " * index}]
    return {
        "model": SERVED_MODEL_NAME,
        "messages": messages,
        "max_completion_tokens": 2,
        "stream": stream,
        "kv_transfer_params": FLAG,
        **NO_THINKING,
    }


def flagged_vector(url: str, body: dict[str, Any]) -> list[float]:
    """The vector of one flagged chat request (streamed or not) to the proxy at ``url``."""
    with lan_client(url) as client:
        if not body["stream"]:
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, (url, response.text)
            return list(response.json()["kv_transfer_params"]["last_hidden_state"])
        vectors = []
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, (url, response.read())
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    if "kv_transfer_params" in chunk:
                        vectors.append(chunk["kv_transfer_params"]["last_hidden_state"])
        assert len(vectors) == 1, f"one vector in the stream, got {len(vectors)}"
        return list(vectors[0])


def check_vectors(
    pool: concurrent.futures.Executor,
    reference: Reference,
    nodes: Sequence[Node],
    per_node: int,
) -> int:
    """``per_node`` flagged requests to every node's proxy, all at once (a quarter streamed):
    each a 200 with its own prompt's vector. Returns how many were sent."""
    jobs = [
        (node, chat_body(node.index, index, stream=index % 4 == 3))
        for index in range(per_node)
        for node in nodes
    ]
    futures = [pool.submit(flagged_vector, node.proxy_url, body) for node, body in jobs]
    for (_, body), future in zip(jobs, futures, strict=True):
        ids = reference.chat_token_ids(body["messages"], enable_thinking=False)
        assert_matches(future.result(), reference.last_hidden_state(ids))
    return len(jobs)


def metrics(url: str) -> str:
    with lan_client(url, timeout=60) as client:
        return client.get("/metrics").text


def engine_core_pids(api_server: int) -> list[int]:
    """The engine-core processes among a vLLM API server's descendants (by their title,
    ``VLLM::EngineCore...``)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            # The field after the parenthesised name, whatever the name holds.
            after_name = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(after_name[1])
    descendants: set[int] = set()
    frontier = {api_server}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    return sorted(pid for pid in descendants if "EngineCore" in " ".join(_cmdline(pid)))


@contextlib.contextmanager
def two_node_cluster(
    model_dir: Path, work_dir: Path, tag: str, *, hook: bool, engines_per_node: int
) -> Iterator[tuple[list[Node], list[Process]]]:
    """Both nodes' vLLMs started (not waited for); stopped and removed at the end."""
    processes: list[Process] = []
    with contextlib.ExitStack() as stack:
        namespaces = stack.enter_context(simulated_lan(tag, 2))
        nodes = [
            stack.enter_context(node(namespace, index, work_dir))
            for index, namespace in enumerate(namespaces)
        ]
        try:
            for each in nodes:
                command = vllm_command(model_dir, each, engines_per_node)
                env = vllm_environment(each, hook, engines_per_node)
                processes.append(each.start("vllm", command, env))
            yield nodes, processes
        finally:
            # Node 1 first: an API server whose engine's peers are gone may wait on them.
            for process in reversed(processes):
                stop_process_group(process.popen, process.name, grace=30)


def each_node_serves_its_own(
    pool: concurrent.futures.Executor,
    reference: Reference,
    nodes: Sequence[Node],
    vllms: Sequence[Process],
    engines_per_node: int,
) -> None:
    """The scenario, once both nodes' vLLMs are healthy: a proxy per node; flagged requests to
    both at once, each with its own vector; each node's requests finished by its own engines,
    each of which publishes into its own node's ring directory only; node 1's engines killed,
    node 0 still serving."""
    layout = f"DP={2 * engines_per_node}, {engines_per_node} engines per node, hybrid LB"

    def engines(node: Node) -> set[str]:
        # vLLM's engine label and the ring's data-parallel index: the node's DP ranks.
        first = node.index * engines_per_node
        return {str(rank) for rank in range(first, first + engines_per_node)}

    proxies = [each.start("proxy", proxy_command(each), dict(os.environ)) for each in nodes]
    try:
        wait_for(
            lambda: all(pool.submit(status, n.proxy_url).result() == 200 for n in nodes),
            "both proxies were healthy",
            [*vllms, *proxies],
            60,
        )
        for each in nodes:
            names = sorted(path.name for path in each.ring_dir.glob("ring-*"))
            indices = {name.rsplit("-dp", 1)[1].removesuffix(".bin") for name in names}
            assert len(names) == engines_per_node and indices == engines(each), names
        per_node = 16
        sent = check_vectors(pool, reference, nodes, per_node)
        for each in nodes:
            text = pool.submit(metrics, each.proxy_url).result()
            served = served_per_engine(text)
            # A node's API server knows only its own engines, and balances over all of them.
            assert set(served) == engines(each), served
            assert all(count > 0 for count in served.values()), served
            assert sum(served.values()) >= per_node, served
            assert proxy_gauge_in(text, "live_rings") == engines_per_node
        COUNTED.append(
            f"two simulated nodes ({layout}): {sent} concurrent flagged requests, half to each "
            "node's proxy, all 200 with their own vectors, each node's requests finished by "
            f"its own engines ({', '.join(sorted(engines(nodes[0])))} and "
            f"{', '.join(sorted(engines(nodes[1])))})"
        )

        # Node 1's engines die (a node failure); node 0 keeps serving flagged requests.
        before = sum(served_per_engine(pool.submit(metrics, nodes[0].proxy_url).result()).values())
        killed = engine_core_pids(vllms[1].popen.pid)
        assert len(killed) == engines_per_node, f"node 1's engine cores: {killed}"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: pool.submit(status, f"http://{nodes[1].address}:{VLLM_PORT}").result() != 200,
            "node 1's vLLM noticed its engines' death",
            [vllms[0], proxies[0]],
            120,
        )
        after = check_vectors(pool, reference, nodes[:1], AFTER_KILL)
        text = pool.submit(metrics, nodes[0].proxy_url).result()
        assert sum(served_per_engine(text).values()) >= before + after
        assert pool.submit(status, nodes[0].proxy_url).result() == 200
        COUNTED.append(
            f"two simulated nodes ({layout}), node 1's engines killed: {after} flagged requests "
            "to node 0, all 200 with their own vectors"
        )
    finally:
        for process in proxies:
            stop_process_group(process.popen, process.name, grace=10)


@contextlib.contextmanager
def vllm_lock_timed(label: str) -> Iterator[None]:
    """The machine-wide vLLM lock (both nodes are one server's worth of this machine); how long
    it was held goes in the run's report: a test's run time without its wait for the lock."""
    with one_vllm_at_a_time():
        started = time.monotonic()
        try:
            yield
        finally:
            COUNTED.append(f"{label}: {time.monotonic() - started:.0f} s with the vLLM lock held")


#: How vLLM 0.32 fails this layout (CPU, tiny dense model), the same with the hook disabled: with
#: one engine per node, ``--data-parallel-hybrid-lb`` turns into external load balancing
#: (arg_utils: "not eligible when data_parallel_size_local = 1"); a dense model then gets no DP
#: coordinator (``VllmConfig.needs_dp_coordinator``), hence no stats address, and every node's
#: API server dies at startup on this assertion in ``DPAsyncMPClient._ensure_stats_update_task``.
VLLM_FAILURE = ("_ensure_stats_update_task", "assert self.stats_update_address is not None")


def vllm_failure(
    pool: concurrent.futures.Executor, nodes: Sequence[Node], vllms: Sequence[Process]
) -> str | None:
    """Wait until both nodes' vLLMs are healthy (None) or one has exited; then, once every one
    has exited, the logs of all (what the test asserts on)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not all(
        pool.submit(status, f"http://{n.address}:{VLLM_PORT}").result() == 200 for n in nodes
    ):
        if any(process.popen.poll() is not None for process in vllms):
            # The other node's API server fails at the same point, or waits on its peer.
            wait_for(
                lambda: all(p.popen.poll() is not None for p in vllms),
                "both nodes' vLLMs had exited",
                [],
                120,
            )
            return "\n".join(process.tail(200) for process in vllms)
        assert time.monotonic() < deadline, "\n".join(p.tail() for p in vllms)
        time.sleep(0.5)
    return None


def assert_documented_failure(logs: str, vllms: Sequence[Process]) -> None:
    for process in vllms:
        assert process.popen.returncode not in (0, None), process.tail()
        text = process.log.read_text(errors="replace")
        assert all(line in text for line in VLLM_FAILURE), (
            f"{process.name} failed otherwise than docs/deploy.md says:\n{logs}"
        )


@pytest.mark.parametrize("hook", [False, True], ids=["hook-disabled", "hook-enabled"])
def test_two_nodes_of_one_engine_each_fail_at_vllm_startup(
    tiny_model_dir: Path, tmp_path: Path, hook: bool
) -> None:
    """vLLM itself fails docs/deploy.md's two-node layout with one engine per node, with or
    without this project's hook: exactly :data:`VLLM_FAILURE`, on both nodes.

    When a vLLM release fixes it, this test fails: then drop it, run
    :func:`test_two_nodes_each_proxy_serves_its_own_engines_vectors` with one engine per node
    too, and update docs/deploy.md and the README's Limits.
    """
    tag = f"hsp{os.getpid() % 100000}"
    hook_state = "enabled" if hook else "disabled"
    with (
        vllm_lock_timed(f"two simulated nodes, one engine each, hook {hook_state}"),
        concurrent.futures.ThreadPoolExecutor(
            4, initializer=in_network_namespace(f"{tag}-lan")
        ) as pool,
        two_node_cluster(tiny_model_dir, tmp_path, tag, hook=hook, engines_per_node=1) as (
            nodes,
            vllms,
        ),
    ):
        logs = vllm_failure(pool, nodes, vllms)
        assert logs is not None, "vLLM now runs one engine per node: see the docstring"
        assert_documented_failure(logs, vllms)
        COUNTED.append(
            f"two simulated nodes, one engine each, hook {hook_state}: "
            "both vLLM API servers exit at startup on vLLM's own assertion "
            "(stats_update_address), as documented"
        )


def test_two_nodes_each_proxy_serves_its_own_engines_vectors(
    tiny_model_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    """Two engines per node (DP=4, ``--data-parallel-size-local 2``): flagged requests to both
    nodes' proxies at once each get their own vector from their own node's engines; with node
    1's engines killed, node 0 keeps serving."""
    tag = f"hsp{os.getpid() % 100000}"
    with (
        vllm_lock_timed("two simulated nodes, two engines each"),
        concurrent.futures.ThreadPoolExecutor(
            32, initializer=in_network_namespace(f"{tag}-lan")
        ) as pool,
        two_node_cluster(tiny_model_dir, tmp_path, tag, hook=True, engines_per_node=2) as (
            nodes,
            vllms,
        ),
    ):
        assert vllm_failure(pool, nodes, vllms) is None
        each_node_serves_its_own(pool, reference, nodes, vllms, engines_per_node=2)
